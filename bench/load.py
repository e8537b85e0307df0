"""Load test of a real `proctor serve` process on loopback: bounded in count and in time.

For each concurrency level it prints requests/s, p50/p99 latency and the count of requests
sent, answered, refused (RESOURCE_EXHAUSTED, the queue's pushback) and lost (anything else:
no answer, a wrong answer, an unexpected error). Lost must be 0.

    .venv/bin/python bench/load.py [--levels 1,16,128,512] [--requests 1024] [--seconds 30]
    .venv/bin/python bench/load.py --engine vllm --replicas 2 --kill-after 3   # SIGKILL an EngineCore mid-run

With `--kill-after S`, S seconds into each level the EngineCore process of one vLLM replica
(alternating) is killed with SIGKILL; the row then also says which replica, and lost must still
be 0 (its requests are retried on the other replica while it restarts).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.server.cli.tiny_model import make_tiny_model

from support.servers import SubprocessServer, engine_cores


def kill_engine_core(server: SubprocessServer, replica: str) -> str:
    """SIGKILL the EngineCore of `replica` (once it is back up after an earlier kill)."""
    deadline = time.monotonic() + 300
    while (core := engine_cores(server).get(replica)) is None:
        if time.monotonic() > deadline:
            return "none"
        time.sleep(0.5)
    os.kill(core.pid, signal.SIGKILL)
    return f"{replica} (pid {core.pid})"


def wait_until_all_healthy(server: SubprocessServer, timeout: float = 300) -> None:
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [r.state for t in stub.ListTeachers(scoring_pb2.TeachersRequest()).teachers for r in t.replicas]
        if all(state == scoring_pb2.HEALTHY for state in states):
            return
        time.sleep(0.5)
    raise TimeoutError("replicas did not all come back")


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
                    # The server's pushback (queue full; no healthy replica while one restarts) is
                    # "refused": a client retries it after the hint. Anything else is lost.
                    pushback = error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
                    counts["refused" if pushback else "lost"] += 1
                    if pushback:
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
    parser.add_argument("--engine", default="torch", help="torch | vllm")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--kill-after", type=float, default=None,
                        help="vllm: seconds into each level at which one replica's EngineCore is SIGKILLed")
    args = parser.parse_args()
    vllm = args.engine == "vllm"
    # vLLM's CPU attention needs head_dim >= 32.
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="proctor-load-")) / "teacher",
                            **({"num_heads": 2, "num_kv_heads": 1} if vllm else {}))
    engine_args = ["--engine", "vllm", "--device", "cpu", "--max-model-len", "1024", "--max-topk", "8",
                   "--inference", "gpu_memory_utilization=0.12", "--inference", "enforce_eager=true",
                   "--health-check-interval-s", "1"] if vllm else ["--no-verbose"]
    server = SubprocessServer(["--model", str(model), "--replicas", str(args.replicas), *engine_args,
                               "--max-queue-requests", str(args.max_queue_requests)], startup_timeout=600)
    try:
        print(f"tiny teacher on {args.replicas} {args.engine} replica(s), {args.length}-token sequences, top-4; "
              f"queue limit {args.max_queue_requests} requests")
        print(f"{'concurrency':>11} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'sent':>6} {'answered':>9} "
              f"{'refused':>8} {'lost':>5}  killed")
        for index, concurrency in enumerate(int(x) for x in args.levels.split(",")):
            wait_until_all_healthy(server)  # a replica killed in the previous level is back
            killed = "-"
            if args.kill_after is not None:
                killed_box: list[str] = []
                timer = threading.Timer(args.kill_after, lambda r=f"default-{index % args.replicas}", box=killed_box:
                                        box.append(kill_engine_core(server, r)))
                timer.start()
            row = asyncio.run(level(server.grpc_target, concurrency, args.requests, args.seconds, args.length))
            if args.kill_after is not None:
                timer.join()
                killed = killed_box[0] if killed_box else "not reached"
            print(f"{concurrency:>11} {row['rps']:>8.1f} {row['p50']:>8.1f} {row['p99']:>8.1f} {row['sent']:>6} "
                  f"{row['answered']:>9} {row['refused']:>8} {row['lost']:>5}  {killed}", flush=True)
    finally:
        code = server.stop()
    print(f"server exit code after SIGTERM: {code}")


if __name__ == "__main__":
    main()
