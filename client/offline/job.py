"""`proctor score-dataset`'s job: a dataset scored through `TeacherClient`, block by block, into shards.

A client of the service, never a second server: every sequence is a scoring request to a running
teacher, many in flight (`max_concurrency` requests over `blocks_in_flight` blocks, so the
teacher's batches stay full while a finished block is encoded and written), each with its own
`prompt_length` (the server reuses a prompt that sequences share). Blocks already stored are
skipped (`store.DatasetStore`), so the same command run again after a kill resumes exactly once.
`ray_job` runs the same `score_block` on a Ray Data pipeline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from proctor.client.client import ScoreInput, TeacherClient
from proctor.client.offline import codecs
from proctor.client.offline.identity import DatasetIdentity, proctor_version
from proctor.client.offline.inputs import InputRows, RowEncoder
from proctor.client.offline.shards import shard_table, write_shard
from proctor.client.offline.store import DatasetStore, ShardEntry


@dataclass(frozen=True)
class JobSettings:
    """What one scoring job reads, asks the teacher for, and writes (the CLI's flags)."""

    source: str
    out: str
    target: str
    teacher_key: str | None = None
    topk: int = 64
    temperature: float | None = None
    topk_form: str = codecs.MAIN_FORM
    logprobs: bool = True
    score_ids_column: str = ""
    hidden_form: str | None = None  # None: no hidden states; "": the teacher's dtype
    block_rows: int = 256
    max_concurrency: int = 64
    blocks_in_flight: int = 4
    tokenizer: str | None = None
    split: str = "train"
    token: str | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.topk_form not in codecs.TOPK_FORMS:
            raise ValueError(f"topk_form: one of {', '.join(codecs.TOPK_FORMS)}, got {self.topk_form!r}")
        if self.block_rows < 1 or self.max_concurrency < 1 or self.blocks_in_flight < 1:
            raise ValueError("block_rows, max_concurrency and blocks_in_flight must be >= 1")
        if self.topk < 0:
            raise ValueError(f"topk: must be >= 0, got {self.topk}")

    def client(self) -> TeacherClient:
        return TeacherClient(self.target, token=self.token, max_concurrency=self.max_concurrency, timeout=self.timeout)


@dataclass
class JobReport:
    """What a run did: blocks written now and found done, rows, scored positions, bytes, seconds."""

    written: list[ShardEntry] = field(default_factory=list)
    skipped: int = 0
    seconds: float = 0.0

    @property
    def rows(self) -> int:
        return sum(e.rows for e in self.written)

    @property
    def positions(self) -> int:
        return sum(e.positions for e in self.written)


async def job_identity(client: TeacherClient, settings: JobSettings, inputs: InputRows) -> DatasetIdentity:
    """The identity this job's shards will carry: the teacher as the server lists it now."""
    info = await client.teacher_for_key(settings.teacher_key)
    return DatasetIdentity(
        teacher=info.name, model=info.model, fingerprint=info.fingerprint, vocab_size=info.vocab_size,
        topk=settings.topk, temperature=settings.temperature, topk_form=settings.topk_form,
        id_bits=codecs.id_bits(info.vocab_size), logprobs=settings.logprobs,
        score_ids_column=settings.score_ids_column, hidden_form=settings.hidden_form or "",
        hidden_states=settings.hidden_form is not None, input_fingerprint=inputs.fingerprint,
        input_rows=inputs.num_rows, block_rows=settings.block_rows, proctor=proctor_version(),
    )


def request_fields(settings: JobSettings) -> dict:
    """The fields every sequence's request shares (`RequestFields`)."""
    fields = {"teacher_key": settings.teacher_key, "logprobs": settings.logprobs, "topk": settings.topk,
              "temperature": settings.temperature}
    if settings.hidden_form is not None:
        fields.update(hidden_states=True, hidden_form=settings.hidden_form)
    return fields


async def score_block(client: TeacherClient, settings: JobSettings, identity: DatasetIdentity, inputs: InputRows,
                      encoder: RowEncoder, block: int) -> Path:
    """Score block `block`'s sequences and write its shard (atomically); the shard's path."""
    start = block * settings.block_rows
    rows = await asyncio.to_thread(lambda: encoder.encode_block(start, inputs.block(block, settings.block_rows)))
    requests = [ScoreInput(r.token_ids, prompt_length=r.prompt_length, score_ids=r.score_ids) for r in rows]
    scores = await client.score_many(requests, **request_fields(settings))

    def write() -> Path:
        table = shard_table([r.index for r in rows], [r.token_ids for r in rows], scores, identity)
        return write_shard(Path(settings.out), block, table, identity)

    return await asyncio.to_thread(write)


async def run_job(settings: JobSettings, on_shard: Callable[[ShardEntry, JobReport], None] | None = None,
                  on_start: Callable[[DatasetStore], None] | None = None) -> JobReport:
    """Score every block not yet stored under `settings.out`; `on_shard` hears of each shard written."""
    inputs = await asyncio.to_thread(InputRows, settings.source, split=settings.split)
    encoder = RowEncoder(settings.tokenizer, settings.score_ids_column)
    report = JobReport()
    started = time.perf_counter()
    async with settings.client() as client:
        identity = await job_identity(client, settings, inputs)
        store = DatasetStore.open_for(settings.out, identity)
        todo = store.todo()
        report.skipped = identity.blocks - len(todo)
        if on_start is not None:
            on_start(store)
        pending = iter(todo)

        async def worker() -> None:
            for block in pending:
                await score_block(client, settings, identity, inputs, encoder, block)
                report.written.append(store.add(block))
                report.seconds = time.perf_counter() - started
                if on_shard is not None:
                    on_shard(report.written[-1], report)

        try:
            async with asyncio.TaskGroup() as group:  # a failed block cancels the others
                for _ in range(settings.blocks_in_flight):
                    group.create_task(worker())
        except ExceptionGroup as failed:  # the first block's failure, as the caller would see it alone
            raise failed.exceptions[0] from None
    store.write_manifest()
    report.seconds = time.perf_counter() - started
    return report
