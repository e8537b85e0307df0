"""OpenAI `echo` + `logprobs` (lm-eval's log-likelihood call) through proctor beside stock vLLM 0.32
answering the identical request: same tiny float32 teacher, same engine (vLLM), same memory.

In one run, phases alternated for `--rounds` rounds, each phase on sequences no phase scored
before (no prefix cache or prompt reuse answers from memory):
- proctor `/v1/completions` with `echo: true, logprobs: 1, max_tokens: 1, temperature: 0`, the
  body lm-eval 0.4.13's `local-completions` sends, N prompts of L tokens per call batch;
- stock vLLM's `/v1/completions` with the same bodies;
- proctor gRPC on the same load (top-1 and log-probs: what the echo answer carries);
and prints, per phase, the best round's scored tokens/s, the CPU seconds per 1k scored tokens of
each server's whole process tree (front, replica worker, EngineCore: CPU-s are the load-independent
figure on a shared host), proctor's front process alone, and the ratios (goal: echo through
proctor >= 3x stock's tokens/s). The answers are compared too: the same token_logprobs within
1e-4 and the same greedy token.

    .venv/bin/python bench/echo_bench.py [--seqs 32 --length 256 --rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.client import TeacherClient
from proctor.server.cli.tiny_model import make_tiny_model

from support.cpu import process_cpu, tree_cpu
from support.servers import SubprocessServer
from support.stock_vllm import StockServer

BODY = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
BATCH = 4  # prompts per call, as lm-eval batches them


@dataclass
class Phase:
    name: str
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    front_cpu: list[float] = field(default_factory=list)
    tokens: int = 0


async def echo_calls(url: str, model: str, seqs: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        answers = await asyncio.gather(*(http.post(url + "/v1/completions", json={
            "model": model, "prompt": seqs[i:i + BATCH], **BODY}) for i in range(0, len(seqs), BATCH)))
    for answer in answers:
        if answer.status_code != 200:
            raise RuntimeError(f"{url}: {answer.status_code} {answer.text[:300]}")
    return [choice for answer in answers for choice in sorted(answer.json()["choices"], key=lambda c: c["index"])]


async def measure(phase: Phase, pid: int, work, tokens: int) -> object:
    root = psutil.Process(pid)
    cpu0, front0 = tree_cpu(pid), process_cpu(root)
    started = time.perf_counter()
    out = await work()
    phase.seconds.append(time.perf_counter() - started)
    phase.cpu.append(tree_cpu(pid) - cpu0)
    phase.front_cpu.append(process_cpu(root) - front0)
    phase.tokens = tokens
    return out


def compare(ours: list[dict], theirs: list[dict]) -> float:
    """Largest |delta token_logprob| between the two answers; the generated tokens must agree."""
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        la, lb = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
        assert len(la) == len(lb) and la[0] is None and lb[0] is None
        worst = max(worst, max(abs(x - y) for x, y in zip(la[1:], lb[1:], strict=True)))
        assert a["logprobs"]["tokens"][-1] == b["logprobs"]["tokens"][-1], "generated tokens differ"
    return worst


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    args = parser.parse_args()
    rng = random.Random(0)

    def fresh() -> list[list[int]]:
        return [[rng.randrange(3, 500) for _ in range(args.length)] for _ in range(args.seqs)]

    tokens = args.seqs * args.length
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "teacher")
        proctor = SubprocessServer(["--engine", "vllm", "--model", str(model), "--dtype", "float32", "--max-topk", "64",
                                    "--teacher-name", "bench", "--max-model-len", "2048",
                                    "--inference", f"gpu_memory_utilization={args.gpu_memory_utilization}",
                                    "--inference", "enforce_eager=true", "--no-verbose"], startup_timeout=600)
        stock = StockServer(model, args.gpu_memory_utilization, 2048)
        phases = {name: Phase(name) for name in ("proctor echo", "stock echo", "proctor gRPC")}
        worst = 0.0
        try:
            async with TeacherClient(proctor.grpc_target, max_concurrency=args.seqs) as client:
                warm = fresh()[:BATCH]
                compare(await echo_calls(proctor.http_url, "bench", warm), await echo_calls(stock.url, str(model), warm))
                for _ in range(args.rounds):
                    shared = fresh()  # the same prompts to both servers, once each: no cache between them
                    ours = await measure(phases["proctor echo"], proctor.proc.pid,
                                         lambda s=shared: echo_calls(proctor.http_url, "bench", s), tokens)
                    theirs = await measure(phases["stock echo"], stock.proc.pid,
                                           lambda s=shared: echo_calls(stock.url, str(model), s), tokens)
                    worst = max(worst, compare(ours, theirs))
                    grpc_seqs = fresh()
                    await measure(phases["proctor gRPC"], proctor.proc.pid, lambda s=grpc_seqs: asyncio.gather(
                        *(client.score(ids, topk=1) for ids in s)), tokens)
        finally:
            stock.stop()
            proctor.stop()
    print(f"{args.seqs} prompts x {args.length} tokens a phase, {args.rounds} rounds alternated, fresh prompts each")
    print(f"{'phase':<14} {'tokens/s':>10} {'tree CPU-s/1k tok':>18} {'front CPU-s/1k tok':>19}")
    best = {}
    for phase in phases.values():
        index = min(range(len(phase.seconds)), key=phase.seconds.__getitem__)
        best[phase.name] = phase.tokens / phase.seconds[index]
        print(f"{phase.name:<14} {best[phase.name]:>10.0f} {1000 * min(phase.cpu) / phase.tokens:>18.3f} "
              f"{1000 * min(phase.front_cpu) / phase.tokens:>19.3f}")
    ratio = best["proctor echo"] / best["stock echo"]
    cpu_ratio = min(phases["stock echo"].cpu) / min(phases["proctor echo"].cpu)
    print(f"echo through proctor / stock vLLM: {ratio:.2f}x tokens/s (goal >= 3x: "
          f"{'met' if ratio >= 3 else 'MISSED'}), {cpu_ratio:.2f}x less CPU per token")
    print(f"echo / gRPC through proctor: {best['proctor echo'] / best['proctor gRPC']:.2f}x tokens/s")
    print(f"largest |delta token_logprob| proctor vs stock: {worst:.2e}; generated tokens equal")


if __name__ == "__main__":
    asyncio.run(main())
