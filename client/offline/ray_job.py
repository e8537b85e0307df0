"""`proctor score-dataset --ray`: the same job as a Ray Data pipeline, past one machine.

The pipeline's items are the blocks still to score (the resume rule of `store`, decided once by
the driver); `map_batches` hands each block to a pool of scoring actors, each of which reads its
block's rows from the source, scores them against the teacher fleet through its own
`TeacherClient` and writes the block's shard with the one writer the single-process job uses
(`job.score_block`), so shards, manifest and resume rule are the same. Rows are read by block in
the actors rather than by `ray.data.read_*`, whose blocks follow files, not fixed row ranges: a
restarted job must cut the same blocks. The driver records each shard as its block comes back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from proctor.client.offline.identity import DatasetIdentity
from proctor.client.offline.inputs import InputRows, RowEncoder
from proctor.client.offline.job import JobReport, JobSettings, job_identity, score_block
from proctor.client.offline.store import DatasetStore, ShardEntry


class BlockScorer:
    """A Ray Data actor: scores and writes the blocks it is handed (`{"block": [...]}` batches)."""

    def __init__(self, settings: JobSettings, identity: dict) -> None:
        self.settings = settings
        self.identity = DatasetIdentity.from_json(identity)
        self.inputs = InputRows(settings.source, split=settings.split)
        if self.inputs.fingerprint != self.identity.input_fingerprint:
            raise RuntimeError(f"{settings.source} on this node is not the input the job started with "
                               f"({self.inputs.fingerprint} != {self.identity.input_fingerprint})")
        self.encoder = RowEncoder(settings.tokenizer, settings.score_ids_column)
        self.loop = asyncio.new_event_loop()

    def __call__(self, batch: dict) -> dict:
        blocks = [int(b) for b in batch["block"]]

        async def run() -> None:
            async with self.settings.client() as client:
                for block in blocks:
                    await score_block(client, self.settings, self.identity, self.inputs, self.encoder, block)

        self.loop.run_until_complete(run())
        return {"block": np.asarray(blocks, dtype=np.int64)}


def _identity(settings: JobSettings, inputs: InputRows) -> DatasetIdentity:
    async def ask() -> DatasetIdentity:
        async with settings.client() as client:
            return await job_identity(client, settings, inputs)

    return asyncio.run(ask())


def run_ray_job(settings: JobSettings, *, actors: int = 2, cpus_per_actor: float = 1.0, address: str | None = None,
                on_shard: Callable[[ShardEntry, JobReport], None] | None = None,
                on_start: Callable[[DatasetStore], None] | None = None) -> JobReport:
    """Score every block not yet stored under `settings.out` on a Ray Data pipeline of `actors`
    scoring actors (Ray is started, or joined at `address`, when not yet initialised)."""
    import time

    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    started = time.perf_counter()
    inputs = InputRows(settings.source, split=settings.split)
    identity = _identity(settings, inputs)
    store = DatasetStore.open_for(settings.out, identity)
    todo = store.todo()
    report = JobReport(skipped=identity.blocks - len(todo))
    if on_start is not None:
        on_start(store)
    if todo:
        pipeline = ray.data.from_items([{"block": b} for b in todo], override_num_blocks=len(todo)).map_batches(
            BlockScorer, fn_constructor_args=(settings, identity.to_json()), batch_size=1,
            concurrency=min(actors, len(todo)), num_cpus=cpus_per_actor)
        for row in pipeline.iter_rows():
            report.written.append(store.add(int(row["block"])))
            report.seconds = time.perf_counter() - started
            if on_shard is not None:
                on_shard(report.written[-1], report)
    store.write_manifest()
    report.seconds = time.perf_counter() - started
    return report
