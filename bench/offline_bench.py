"""Offline teacher signals: bytes a stored position costs at K=64 in each form, with its KL, and the
`score-dataset` job's throughput against the online gRPC path on the same server.

One run, side by side, through the tiny teacher served on loopback by `proctor serve` in a process
of its own (the job and the online client share this one):

1. sizes: N sequences scored once online (exact float32 top-64); each form's shard written with
   the job's writer (`shards.shard_table`, zstd) and read back: bytes a scored position (the
   whole file, and the teacher-signal columns alone) and the mean KL(exact top-k ‖ stored top-k),
   both renormalised over the K ids, in nats; beside them the common layout (int32 ids + float16
   log-probs, 384 B uncompressed) that the goal halves;
2. throughput: rounds alternating the online path (`TeacherClient.score_many`, the same K,
   concurrency and prompt lengths, answers dropped) and the job (`run_job`: read, score, encode,
   write shards), fresh sequences every round so that no round reads a prefix another left;
   scored positions a second each, and their ratio (median over rounds; the order alternates), and
   the client-side CPU a position costs each (this process's: what the job adds beside the
   server's work, a figure machine load moves little).

    PYTHONPATH=.shim .venv/bin/python bench/offline_bench.py [--seqs 512] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from proctor.client import TeacherClient
from proctor.client.offline import JobSettings, OfflineScores, codecs, run_job
from proctor.client.offline.identity import DatasetIdentity
from proctor.client.offline.shards import shard_table, write_shard

K = 64
SIGNAL_COLUMNS = ("logprobs", "topk_ids", "topk_logprobs", "topk_offset", "topk_scale")


def workload(count: int, seed: int, vocab: int, length: tuple[int, int]) -> list[tuple[list[int], int]]:
    """(ids, prompt_length): groups of four responses share one prompt (as a GRPO group does)."""
    g = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> list[int]:
        return torch.randint(0, vocab, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    out = []
    for index in range(count):
        if index % 4 == 0:
            prompt = draw(length[0] // 3, length[1] // 3)
        out.append((prompt + draw(length[0], length[1]), len(prompt)))
    return out


def identity(info, form: str, rows: int) -> DatasetIdentity:
    return DatasetIdentity(teacher=info.name, model=info.model, fingerprint=info.fingerprint,
                           vocab_size=info.vocab_size, topk=K, temperature=None, topk_form=form,
                           id_bits=codecs.id_bits(info.vocab_size), logprobs=True, score_ids_column="",
                           hidden_form="", hidden_states=False, input_fingerprint="bench", input_rows=rows,
                           block_rows=rows)


async def sizes(target: str, work, out: Path) -> list[tuple[str, float, float, float]]:
    """(form, file B/position, signal B/position, mean KL) per form."""
    async with TeacherClient(target, max_concurrency=64) as client:
        info = await client.teacher_for_key(None)
        answers = await asyncio.gather(*(client.score(ids, topk=K, prompt_length=p) for ids, p in work))
    positions = sum(a.num_rows for a in answers)
    exact = np.concatenate([a.topk_logprobs.numpy() for a in answers])
    rows = []
    for form in codecs.TOPK_FORMS:
        ident = identity(info, form, len(work))
        directory = out / form
        directory.mkdir()
        table = shard_table(range(len(work)), [ids for ids, _ in work], answers, ident)
        path = write_shard(directory, 0, table, ident)
        meta = pq.read_metadata(path)
        signal = sum(meta.row_group(g).column(c).total_compressed_size for g in range(meta.num_row_groups)
                     for c in range(meta.num_columns) if meta.schema.column(c).path.split(".")[0] in SIGNAL_COLUMNS)
        stored = np.concatenate([s.scores.topk_logprobs.numpy() for s in OfflineScores(directory)])
        rows.append((form, path.stat().st_size / positions, signal / positions,
                     float(codecs.topk_kl(exact, stored).mean())))
    return rows


async def online_round(target: str, work, concurrency: int) -> tuple[int, float]:
    async with TeacherClient(target, max_concurrency=concurrency) as client:
        await client.teachers()
        started = time.perf_counter()
        answers = await asyncio.gather(*(client.score(ids, topk=K, prompt_length=p) for ids, p in work))
        return sum(a.num_rows for a in answers), time.perf_counter() - started


def job_round(target: str, work, concurrency: int, directory: Path) -> tuple[int, float]:
    source = directory / "input.jsonl"
    source.write_text("".join(json.dumps({"token_ids": ids, "prompt_length": p}) + "\n" for ids, p in work))
    settings = JobSettings(source=str(source), out=str(directory / "out"), target=target, topk=K,
                           block_rows=64, max_concurrency=concurrency)
    report = asyncio.run(run_job(settings))
    return report.positions, report.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="128 sequences, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.rounds = 128, 2
    from support.servers import SubprocessServer

    server = SubprocessServer(["--max-topk", str(K), "--no-verbose"])
    try:
        target = f"grpc://{server.grpc_target}"
        tmp = tempfile.mkdtemp()
        length = (48, 200)
        forms = asyncio.run(sizes(target, workload(args.seqs, 1, 512, length), Path(tmp)))
        print(f"K={K}, vocab 512 (ids in {codecs.id_bits(512)} bits), {args.seqs} sequences of {length[0]}-{length[1]} tokens")
        print("form                          file B/position  signal B/position  mean KL vs exact top-k (nats)")
        print(f"{'int32 ids + float16 (common)':30s}{'384.0':>15s}{'384.0':>19s}  {'(the layout the goal halves)':>30s}")
        for form, whole, signal, kl in forms:
            print(f"{form + (' (main)' if form == codecs.MAIN_FORM else ''):30s}{whole:15.1f}{signal:19.1f}  {kl:30.2e}")
        ratios, cpu = [], {"online": [], "job": []}
        for round_ in range(args.rounds):
            seed = 100 + 2 * round_
            rates = {}
            for path in ("online", "job") if round_ % 2 == 0 else ("job", "online"):  # order alternates
                work = workload(args.seqs, seed + (path == "job"), 512, length)
                used = time.process_time()
                if path == "online":
                    positions, seconds = asyncio.run(online_round(target, work, args.concurrency))
                else:
                    directory = Path(tmp) / f"round{round_}"
                    directory.mkdir()
                    positions, seconds = job_round(target, work, args.concurrency, directory)
                rates[path] = positions / seconds
                cpu[path].append((time.process_time() - used) / positions * 1e6)
            ratios.append(rates["job"] / rates["online"])
            print(f"round {round_}: online gRPC {rates['online']:9.0f} positions/s   score-dataset {rates['job']:9.0f} "
                  f"positions/s   job/online {ratios[-1]:.2f}x", flush=True)
        print(f"score-dataset throughput / online gRPC path: {statistics.median(ratios):.2f}x (median of {args.rounds})")
        print(f"client-side CPU per position (this process; the server's is the same work): online "
              f"{statistics.median(cpu['online']):.1f} us, score-dataset {statistics.median(cpu['job']):.1f} us")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
