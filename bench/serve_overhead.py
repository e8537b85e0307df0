"""What the service costs over the bare engine, and what batching buys.

Prints, from one run on one machine (ratios; absolute times on a noisy machine mean little):
  A  the torch engine called in-process on batches of the same inputs (no transport, no worker)
  B  the same inputs through a real `proctor serve` process over gRPC, 32 concurrent clients
  C  the same inputs through gRPC one at a time (serial single requests)
and the ratios B/A (goal >= 0.9) and B/C (goal >= 3).

    .venv/bin/python bench/serve_overhead.py [--workloads short,long] [--quick]

Two workloads: short sequences on the tiny teacher, where a forward pass is mostly fixed
overhead and batching pays most, and longer ones on a 4-layer teacher, where two CPU cores
are already saturated by one sequence and batching has little left to win.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.server.cli.tiny_model import make_tiny_model
from proctor.server.engines.base import EngineRequest, EngineSpec
from proctor.server.engines.factory import create_engine

from support.servers import SubprocessServer


def sequences(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


async def in_process(model: Path, seqs: list[list[int]], topk: int, batch: int) -> float:
    engine = create_engine(EngineSpec(name="torch", model_path=str(model)))
    await engine.start()
    requests = [
        EngineRequest(str(i), torch.tensor(s), first_row=len(s) // 2, logprobs=True, topk=topk, hidden_states=False)
        for i, s in enumerate(seqs)
    ]
    await engine.score(requests[:batch])  # warm-up
    started = time.perf_counter()
    for lo in range(0, len(requests), batch):
        await engine.score(requests[lo : lo + batch])
    elapsed = time.perf_counter() - started
    await engine.close()
    return elapsed


async def through_grpc(target: str, seqs: list[list[int]], topk: int, concurrency: int) -> float:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = scoring_pb2_grpc.TeacherScoringStub(channel)

        def request(ids):
            return scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=len(ids) // 2, logprobs=True, topk=topk)

        await stub.Score(request(seqs[0]))  # warm-up
        queue = list(enumerate(seqs))
        answered = [0]

        async def worker():
            while queue:
                _, ids = queue.pop()
                await stub.Score(request(ids))
                answered[0] += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        assert answered[0] == len(seqs)
        return elapsed


WORKLOADS = {
    # name: (requests, tokens per request, hidden, layers, vocab)
    "short": (512, 64, 64, 2, 512),
    "long": (256, 256, 256, 4, 4096),
}


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of the server's front process and of its replica workers."""
    import psutil

    def used(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return times.user + times.system

    front = psutil.Process(pid)
    return used(front), sum(used(child) for child in front.children())


def run_workload(name: str, requests: int, length: int, hidden: int, layers: int, vocab: int, args) -> None:
    work = Path(tempfile.mkdtemp(prefix="proctor-bench-"))
    model = make_tiny_model(work / "teacher", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                            num_heads=max(1, hidden // 32), num_kv_heads=1, intermediate_size=hidden * 2)
    seqs = sequences(requests, length, vocab)
    tokens = requests * length
    server = SubprocessServer(["--model", str(model), "--max-model-len", str(length + 8), "--no-verbose"])
    try:
        # A and B alternate, best of two each: on a shared machine the load drifts between runs.
        direct_cpu = time.process_time()
        direct = asyncio.run(in_process(model, seqs, args.topk, args.concurrency))
        direct_cpu = time.process_time() - direct_cpu  # includes loading the engine (a few ms)
        (front_cpu, worker_cpu), client_cpu = _cpu_seconds(server.proc.pid), time.process_time()
        batched = asyncio.run(through_grpc(server.grpc_target, seqs, args.topk, args.concurrency))
        front_after, worker_after = _cpu_seconds(server.proc.pid)
        front_cpu, worker_cpu = front_after - front_cpu, worker_after - worker_cpu
        client_cpu = time.process_time() - client_cpu
        direct = min(direct, asyncio.run(in_process(model, seqs, args.topk, args.concurrency)))
        batched = min(batched, asyncio.run(through_grpc(server.grpc_target, seqs, args.topk, args.concurrency)))
        serial = asyncio.run(through_grpc(server.grpc_target, seqs, args.topk, 1))
    finally:
        server.stop()
    print(f"\nworkload {name!r}: teacher hidden {hidden}, {layers} layers, vocab {vocab}; "
          f"{requests} requests x {length} tokens, top-{args.topk}; torch threads {torch.get_num_threads()}")
    print(f"{'path':<44} {'seconds':>9} {'tokens/s':>10}")
    for label, seconds in ((f"A in-process engine, batches of {args.concurrency}", direct),
                           (f"B gRPC, {args.concurrency} concurrent clients", batched),
                           ("C gRPC, serial single requests", serial)):
        print(f"{label:<44} {seconds:>9.3f} {tokens / seconds:>10.0f}")
    print(f"B / A throughput (service vs in-process; goal >= 0.9): {direct / batched:.2f}")
    print(f"   CPU seconds during B: server front {front_cpu:.2f}, its replica worker {worker_cpu:.2f}, "
          f"benchmark client {client_cpu:.2f} "
          f"(the client shares the machine's {os.cpu_count()} cores with the server)")
    busy = front_cpu + worker_cpu + client_cpu
    print(f"   A used {direct_cpu:.2f} CPU-s; B's {busy:.2f} CPU-s on {os.cpu_count()} cores cannot take under "
          f"{busy / os.cpu_count():.3f} s, so on this machine B / A is at most {direct / (busy / os.cpu_count()):.2f}")
    print(f"B / C throughput (batched vs serial; goal >= 3):      {serial / batched:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="short,long", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    print(f"load average at start {os.getloadavg()[0]:.2f}")
    for name in args.workloads.split(","):
        requests, length, hidden, layers, vocab = WORKLOADS[name]
        if args.quick:
            requests, length = 48, 32
        run_workload(name, requests, length, hidden, layers, vocab, args)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
