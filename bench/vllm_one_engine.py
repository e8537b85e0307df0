"""proctor's one-engine vLLM replica beside stock vLLM's OpenAI server, same model, memory, load.

Starts both servers on loopback (`proctor serve --engine vllm`, all outputs on; and
`python -m vllm.entrypoints.openai.api_server`), the same tiny float32 teacher and
`gpu_memory_utilization` each, then in one run:
- memory: the PSS of each server's process tree, and of its engine processes alone (EngineCore
  and its workers), after both served the same requests;
- speed: N sequences of L tokens (default 48 x 480, new ones for every run, so no run reads a
  prefix cache another left) sent at once, the phases alternated for
  `--rounds` rounds (best round each): proctor gRPC top-64, proctor /v1/completions with
  prompt_logprobs=64, stock /v1/completions with prompt_logprobs=64 (what a TRL user runs), and
  stock's bare prefill (max_tokens=1, no prompt log-probs); scored tokens/s and ratios;
- score_ids: K=64 (the student's top-64) vs top-64 through proctor's gRPC, alternated;
- the first hidden-states request after /health/ready (its latency, against a 10 s deadline);
- the gap between gRPC top-64 and stock's bare prefill, split: the row math that a bare prefill
  never does (the teacher's lm_head, log-softmax and top-64 over every scored row: stock computes
  logits for each sequence's last position only), timed here on the same number of rows with the
  teacher's own head in float32 on as many threads as the engine's worker, and the rest (proctor's
  own: front, replica worker, the pooler's bookkeeping, packing, the wire).

    .venv/bin/python bench/vllm_one_engine.py [--seqs 48 --length 480 --rounds 3] [--wide]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.client import TeacherClient
from proctor.server.cli.tiny_model import make_tiny_model

from support.cpu import tree_cpu
from support.servers import SubprocessServer
from support.stock_vllm import StockServer

K = 64


def tree_pss(pid: int) -> tuple[float, float, float]:
    """GB of PSS of (the whole process tree, the replica: the AsyncLLM's process and everything
    below it, its engine processes alone: EngineCore and its children). proctor's replica is its
    replica worker's subtree; stock vLLM's is the whole server (its API process holds the AsyncLLM)."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]

    def subtree(match) -> set[int]:
        return {p.pid for c in procs if match(" ".join(c.cmdline()) + c.name()) for p in [c, *c.children(recursive=True)]}

    cores = subtree(lambda text: "EngineCore" in text)
    hosts = subtree(lambda text: "server.worker.main" in text) or {p.pid for p in procs}
    sizes = {}
    for proc in procs:
        try:
            sizes[proc.pid] = proc.memory_full_info().pss / 1e9
        except psutil.Error:
            continue
    return (sum(sizes.values()), sum(v for k, v in sizes.items() if k in hosts),
            sum(v for k, v in sizes.items() if k in cores))


async def completions(url: str, model: str, seqs: list[list[int]], body: dict) -> float:
    """Seconds to answer every sequence at once through /v1/completions."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(seqs))) as http:
        started = time.perf_counter()
        answers = await asyncio.gather(*(http.post(url + "/v1/completions", json={
            "model": model, "prompt": ids, "max_tokens": 1, **body}) for ids in seqs))
        elapsed = time.perf_counter() - started
    for answer in answers:
        if answer.status_code != 200:
            raise RuntimeError(f"{url}: {answer.status_code} {answer.text[:300]}")
    return elapsed


async def grpc_phase(client: TeacherClient, seqs: list[list[int]], **kwargs) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(client.score(ids, **kwargs) for ids in seqs))
    return time.perf_counter() - started


def row_math_seconds(model: Path, rows: int, *, repeat: int = 5, ranks: bool = False) -> float:
    """Least CPU seconds (this process's, every thread) of the row work a scoring prefill adds to a bare one, on `rows` rows: the
    teacher's own output head (transformers' model of the checkpoint), then `row_scores.score_rows`
    (log-softmax, top-64, the actual token's log-prob; `ranks`: the actual token's rank too, which
    gRPC answers do not carry and the pooler no longer computes for them), as the pooler runs it,
    in its row chunks. Hidden states are random: the cost does not depend on them."""
    from transformers import AutoModelForCausalLM

    from proctor.server.engines.row_scores import score_rows

    head = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).get_output_embeddings()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, head.in_features, generator=generator)
    targets = torch.randint(0, head.out_features, (rows,), generator=generator)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeat + 1):  # the first one warms up
            started = time.process_time()
            score_rows(head, hidden, targets, topk=K, ranks=ranks)
            best = min(best, time.process_time() - started)
    return best


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=48)
    parser.add_argument("--length", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="threads the row math runs on (1: its CPU seconds are its work, no thread waiting on another)")
    parser.add_argument("--wide", action="store_true",
                        help="a 4-layer, 256-wide teacher (default: the 2-layer, 64-wide tiny one)")
    args = parser.parse_args()
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 500) for _ in range(args.length)] for _ in range(args.seqs)]
    max_len = 2048
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=512) if args.wide else {}
        model = make_tiny_model(Path(tmp) / "teacher", **shape)
        proctor = SubprocessServer(["--engine", "vllm", "--model", str(model), "--dtype", "float32",
                                    "--max-topk", str(K), "--teacher-name", "bench", "--max-model-len", str(max_len),
                                    "--inference", f"gpu_memory_utilization={args.gpu_memory_utilization}",
                                    "--inference", "enforce_eager=true", "--no-verbose"], startup_timeout=600)
        try:
            async with TeacherClient(proctor.grpc_target, max_concurrency=args.seqs) as client:
                started = time.perf_counter()
                await client.score(seqs[0][:256], prompt_length=128, hidden_states=True, logprobs=False,
                                   timeout=10)
                first_hidden = time.perf_counter() - started
                stock = StockServer(model, args.gpu_memory_utilization, max_len)
                try:
                    await report(args, seqs, proctor, stock, client, first_hidden)
                finally:
                    stock.stop()
        finally:
            proctor.stop()


async def report(args, seqs, proctor: SubprocessServer, stock: StockServer, client: TeacherClient,
                 first_hidden: float) -> None:
    rng = random.Random(1)

    def fresh() -> list[list[int]]:
        """New sequences for every run: no phase reads a prefix another run left in a cache."""
        return [[rng.randrange(3, 500) for _ in range(args.length)] for _ in range(args.seqs)]

    model = str(stock.proc.args[4])
    phases = {
        "proctor gRPC top-64": lambda: grpc_phase(client, fresh(), topk=K),
        "proctor /v1/completions prompt_logprobs=64": lambda: completions(proctor.http_url, "bench", fresh(),
                                                                          {"prompt_logprobs": K}),
        "stock /v1/completions prompt_logprobs=64": lambda: completions(stock.url, model, fresh(),
                                                                        {"prompt_logprobs": K}),
        "stock bare prefill (max_tokens=1)": lambda: completions(stock.url, model, fresh(), {}),
    }
    for run in phases.values():  # warm-up: every path once
        await run()
    pss = {"proctor": tree_pss(proctor.proc.pid), "stock": tree_pss(stock.proc.pid)}
    best = {name: float("inf") for name in phases}
    cpu: dict[str, list[float]] = {name: [] for name in phases}  # the serving tree's CPU seconds per round
    for _ in range(args.rounds):
        for name, run in phases.items():
            pid = (proctor if name.startswith("proctor") else stock).proc.pid
            before = tree_cpu(pid)
            best[name] = min(best[name], await run())
            cpu[name].append(tree_cpu(pid) - before)
    generator = torch.Generator().manual_seed(0)
    prompt = args.length // 2
    student_topk = [torch.randint(0, 500, (len(ids) - prompt, K), generator=generator, dtype=torch.int32)
                    for ids in seqs]
    ids_vs_topk = {"top-64": float("inf"), "score_ids K=64": float("inf")}
    for _ in range(args.rounds):
        ids_vs_topk["top-64"] = min(ids_vs_topk["top-64"], await grpc_phase(
            client, fresh(), prompt_length=prompt, topk=K, logprobs=False))
        batch = fresh()
        started = time.perf_counter()
        await asyncio.gather(*(client.score(ids, prompt_length=prompt, logprobs=False, score_ids=support)
                               for ids, support in zip(batch, student_topk, strict=True)))
        ids_vs_topk["score_ids K=64"] = min(ids_vs_topk["score_ids K=64"], time.perf_counter() - started)

    tokens = sum(len(s) for s in seqs)
    print(f"\nteacher: {'4 layers x 256' if args.wide else '2 layers x 64'}, vocab 512, float32; "
          f"{len(seqs)} x {args.length} tokens, all sent at once; best of {args.rounds} alternated rounds; "
          f"gpu_memory_utilization {args.gpu_memory_utilization} each\n")
    print(f"{'phase':48s} {'tokens/s':>10s} {'vs stock scoring':>17s} {'vs stock bare':>14s}")
    scoring, bare = best["stock /v1/completions prompt_logprobs=64"], best["stock bare prefill (max_tokens=1)"]
    for name, seconds in best.items():
        print(f"{name:48s} {tokens / seconds:10.0f} {scoring / seconds:16.2f}x {bare / seconds:13.2f}x")
    print(f"\n{'process tree PSS (GB)':48s} {'proctor':>10s} {'stock':>10s} {'ratio':>8s}")
    for index, label in enumerate(("whole tree (proctor: + its front process)", "replica (AsyncLLM process + engine)",
                                   "engine processes (EngineCore + workers)")):
        ours, theirs = pss["proctor"][index], pss["stock"][index]
        print(f"{label:48s} {ours:10.2f} {theirs:10.2f} {ours / theirs:7.2f}x")
    ratio = ids_vs_topk["score_ids K=64"] / ids_vs_topk["top-64"]
    print(f"\nscore_ids K=64 vs top-64 (proctor gRPC, rows from L/2): {ids_vs_topk['score_ids K=64']:.2f}s vs "
          f"{ids_vs_topk['top-64']:.2f}s = {ratio:.2f}x")
    print(f"first hidden-states request after /health/ready: {first_hidden:.2f}s (client deadline 10 s)")
    split_gap(args, seqs, Path(model), best, cpu)


def split_gap(args, seqs: list[list[int]], model: Path, best: dict[str, float], cpu: dict[str, list[float]]) -> None:
    """gRPC top-64 against stock's bare prefill, in CPU seconds of each serving tree a round
    (median round; CPU seconds do not grow with the machine's load as wall seconds do), the gap
    split into the row math bare prefill never does (its CPU seconds here, same rows) and the rest."""
    rows = sum(len(s) - 1 for s in seqs)  # gRPC top-64 scores rows 1..T-1 of every sequence
    torch.set_num_threads(args.engine_threads)
    math, ranked = row_math_seconds(model, rows), row_math_seconds(model, rows, ranks=True)
    grpc_name, bare_name = "proctor gRPC top-64", "stock bare prefill (max_tokens=1)"
    grpc_cpu, bare_cpu = (sorted(cpu[n])[len(cpu[n]) // 2] for n in (grpc_name, bare_name))
    gap = grpc_cpu - bare_cpu
    print(f"\ngRPC top-64 vs stock bare prefill: wall {best[bare_name] / best[grpc_name]:.2f}x; serving-tree CPU "
          f"seconds a round {grpc_cpu:.2f} vs {bare_cpu:.2f} ({bare_cpu / grpc_cpu:.2f}x), gap {gap:.2f}")
    print(f"  row math bare prefill never does (lm_head + log-softmax + top-{K} over {rows} rows, float32, "
          f"{args.engine_threads} threads): {math:.2f} CPU-s = {math / grpc_cpu:.0%} of gRPC's"
          + (f", {math / gap:.0%} of the gap" if gap > 0 else ""))
    print(f"  the rest, proctor's own (front, replica worker, pooler bookkeeping, packing, wire): {gap - math:.2f} "
          f"CPU-s = {(gap - math) / grpc_cpu:.0%} of gRPC's; without the row math: {bare_cpu / (grpc_cpu - math):.2f}x")
    print(f"  the row math with every row's rank too (what the pooler computed for gRPC before): {ranked:.2f} CPU-s; "
          f"the ranks were {ranked - math:.2f} = {(ranked - math) / ranked:.0%} of it")


if __name__ == "__main__":
    asyncio.run(main())
