"""Least-outstanding vs round-robin routing over heterogeneous replicas, side by side.

Two replicas of the tiny teacher: one as is, one slowed by a per-token delay (a slower or
busier device, simulated with the test support's `InjectedEngine` around a real torch
engine). The same closed-loop load (a fixed number of requests in flight) runs through a
ReplicaSet with each policy; the table shows requests/s and the ratio least-outstanding /
round-robin (goal ≥ 1.3), and how many requests the slow replica took.

    python bench/routing_bench.py [--requests 240] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.server.cli.tiny_model import make_tiny_model
from proctor.server.engines.base import EngineRequest, EngineSpec
from proctor.server.engines.factory import create_engine
from proctor.server.front.fleet.routing import Replica, ReplicaSet

from support.engines import InjectedEngine


def _requests(count: int, seed: int = 0) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(64, 192, (1,), generator=g))
        ids = torch.randint(0, 512, (n,), generator=g)
        out.append(EngineRequest(f"r{i}", ids, n // 2, logprobs=True, topk=0, hidden_states=False))
    return out


async def _run(model_dir: str, policy: str, slow_per_token_s: float, requests: list[EngineRequest],
               concurrency: int) -> tuple[float, int]:
    """Requests per second, and how many requests the slow replica scored."""
    spec = EngineSpec("torch", model_dir, dtype="float32")
    engines = [InjectedEngine(create_engine(spec)), InjectedEngine(create_engine(spec), delay_per_token_s=slow_per_token_s)]

    def factory(engine):
        async def build():
            return engine

        return build

    teacher = ReplicaSet("bench", [Replica(f"r{i}", factory(e)) for i, e in enumerate(engines)], policy=policy,
                      health_check_interval_s=None)
    await teacher.start()
    try:
        await teacher.score(requests[0])  # warm-up
        for e in engines:
            e.requests = 0
        gate = asyncio.Semaphore(concurrency)

        async def one(request: EngineRequest) -> None:
            async with gate:
                await teacher.score(request)

        started = time.perf_counter()
        await asyncio.gather(*(one(r) for r in requests))
        elapsed = time.perf_counter() - started
        return len(requests) / elapsed, engines[1].requests
    finally:
        await teacher.stop()


async def main(args: argparse.Namespace) -> None:
    model_dir = str(make_tiny_model(tempfile.mkdtemp(prefix="proctor-bench-")))
    requests = _requests(args.requests)
    print(f"{args.requests} requests (64-191 tokens), {args.concurrency} in flight, replicas: fast + slow")
    print(f"{'slow replica delay':>20} | {'round-robin req/s':>17} | {'least-outst. req/s':>18} | "
          f"{'ratio LO/RR':>11} | {'slow share RR':>13} | {'slow share LO':>13}")
    for delay_ms in args.delays_ms:
        rr, rr_slow = await _run(model_dir, "round_robin", delay_ms / 1000, requests, args.concurrency)
        lo, lo_slow = await _run(model_dir, "least_outstanding", delay_ms / 1000, requests, args.concurrency)
        n = len(requests)
        print(f"{f'{delay_ms:g} ms/token':>20} | {rr:17.1f} | {lo:18.1f} | {lo / rr:11.2f} | "
              f"{rr_slow / n:13.0%} | {lo_slow / n:13.0%}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[0.05, 0.2, 0.5])
    asyncio.run(main(parser.parse_args()))
