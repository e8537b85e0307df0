"""Load test of a real `proctor serve` process on loopback: bounded in count and in time.

For each concurrency level it prints requests/s, p50/p99 latency and the count of requests
sent, answered, refused (RESOURCE_EXHAUSTED, the queue's pushback) and lost (anything else:
no answer, a wrong answer, an unexpected error). Lost must be 0.

    .venv/bin/python bench/load.py [--levels 1,16,128,512] [--requests 1024] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.server.tiny_model import make_tiny_model

from conftest import SubprocessServer


async def level(target: str, concurrency: int, total: int, seconds: float, length: int) -> dict:
    rng = random.Random(concurrency)
    latencies: list[float] = []
    counts = {"sent": 0, "answered": 0, "refused": 0, "lost": 0}
    deadline = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(target) as channel:
        stub = scoring_pb2_grpc.TeacherScoringStub(channel)

        async def worker(index: int) -> None:
            while counts["sent"] < total and time.monotonic() < deadline:
                counts["sent"] += 1
                ids = [rng.randrange(512) for _ in range(length)]
                request = scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=length // 2, logprobs=True, topk=4,
                                                   request_id=f"{concurrency}-{index}-{counts['sent']}")
                started = time.perf_counter()
                try:
                    reply = await stub.Score(request, timeout=60)
                except grpc.aio.AioRpcError as error:
                    counts["refused" if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "lost"] += 1
                    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        await asyncio.sleep(0.01)
                    continue
                ok = reply.request_id == request.request_id and reply.logprobs.shape[0] == length - length // 2
                counts["answered" if ok else "lost"] += 1
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    p = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000) if latencies else (lambda q: 0.0)
    return {**counts, "rps": counts["answered"] / elapsed, "p50": p(0.5), "p99": p(0.99),
            "median_ok": statistics.median(latencies) * 1000 if latencies else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,16,128,512")
    parser.add_argument("--requests", type=int, default=1024, help="per level, at most")
    parser.add_argument("--seconds", type=float, default=30, help="per level, at most")
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--max-queue-requests", type=int, default=256)
    args = parser.parse_args()
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="proctor-load-")) / "teacher")
    server = SubprocessServer(["--model", str(model), "--no-verbose", "--max-queue-requests", str(args.max_queue_requests)])
    try:
        print(f"tiny teacher, {args.length}-token sequences, top-4; queue limit {args.max_queue_requests} requests")
        print(f"{'concurrency':>11} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'sent':>6} {'answered':>9} {'refused':>8} {'lost':>5}")
        for concurrency in (int(x) for x in args.levels.split(",")):
            row = asyncio.run(level(server.grpc_target, concurrency, args.requests, args.seconds, args.length))
            print(f"{concurrency:>11} {row['rps']:>8.1f} {row['p50']:>8.1f} {row['p99']:>8.1f} {row['sent']:>6} "
                  f"{row['answered']:>9} {row['refused']:>8} {row['lost']:>5}", flush=True)
    finally:
        code = server.stop()
    print(f"server exit code after SIGTERM: {code}")


if __name__ == "__main__":
    main()
