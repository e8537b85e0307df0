"""score_ids K=64 (the teacher at the student's top-64) vs the teacher's own top-64, per engine.

One run, side by side, N sequences of L tokens (default 32 x 512, prompt_length L/2) through an
in-process `ScoringService` over a small local teacher (as `engine_bench.py`): teacher time
(best of `--repeat`) and bytes a scored token costs on the wire, request and answer apart
(score_ids travel in the request, 4 bytes an id; top-k answers ids and log-probs, 8 bytes a pair).

    .venv/bin/python bench/score_ids_bench.py [--quick] [--engines torch,vllm]

`--grpc` measures instead what a trainer sees: `proctor serve` in its own process (the tiny
teacher), a TeacherClient sending N sequences at once (fresh ids every round, so no round reads
a prefix another left), top-64 and score_ids rounds alternated, best of `--repeat`; beside the
wall time, the CPU seconds each process of the server spent per round (front, replica worker,
vLLM's EngineCore), which says where a difference comes from independently of machine load:

    .venv/bin/python bench/score_ids_bench.py --grpc --engines vllm --seqs 16 --length 400 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_bench import make_teacher

K = 64


async def bench(name: str, model: Path, args, seqs: list[list[int]], vocab: int) -> dict[str, tuple[float, float, float]]:
    from proctor.proto import encode_tensor, scoring_pb2
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.responses import Responses
    from proctor.server.front.service import ScoringService

    inference = {"max_model_len": max(2048, args.length + 1), "max_num_batched_tokens": 16384}
    if name == "vllm":
        inference["gpu_memory_utilization"] = args.gpu_memory_utilization
    spec = EngineSpec(name=name, model_path=str(model), device=args.device, dtype="float32", max_topk=K,
                      inference=inference)
    service = ScoringService(single_teacher_router(spec, name="bench"))
    await service.start()
    answers = Responses(service.metrics)
    print(f"  {name}: score_ids by {service.teacher_infos()[0].score_ids_method}", file=sys.stderr, flush=True)
    generator = torch.Generator().manual_seed(0)

    def requests(mode: str) -> list[scoring_pb2.ScoreRequest]:
        out = []
        for i, ids in enumerate(seqs):
            first = len(ids) // 2
            request = scoring_pb2.ScoreRequest(request_id=str(i), token_ids=ids, prompt_length=first, logprobs=False)
            if mode == "topk":
                request.topk = K
            else:  # a stand-in for the student's top-64: any K distinct-enough ids per row
                support = torch.randint(0, vocab, (len(ids) - first, K), generator=generator, dtype=torch.int32)
                request.score_ids.CopyFrom(encode_tensor(support, first_row=first))
            out.append(request)
        return out

    results = {}
    try:
        for mode in ("topk", "score_ids"):
            batch = requests(mode)
            await asyncio.gather(*(service.score(r) for r in batch[:4]))  # warm-up
            best, scored = float("inf"), []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                scored = await asyncio.gather(*(service.score(r) for r in batch))
                best = min(best, time.perf_counter() - t0)
            rows = sum(len(ids) - len(ids) // 2 for ids in seqs)
            sent = sum(r.score_ids.ByteSize() for r in batch if r.HasField("score_ids")) / rows  # beyond the ids
            answered = sum(answers.message(s).ByteSize() for s in scored) / rows
            results[mode] = (best, sent, answered)
            print(f"  {name} {mode}: {best:.2f}s, {sent:.0f} + {answered:.0f} B/token", file=sys.stderr, flush=True)
    finally:
        await service.stop()
    return results


def _server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server's processes, by role: the front (the `proctor serve`
    process), the replica worker, vLLM's EngineCore (with its children)."""
    import psutil

    root = psutil.Process(pid)
    roles = {"front": 0.0, "worker": 0.0, "engine": 0.0}
    for proc in [root, *root.children(recursive=True)]:
        try:
            text, times = " ".join(proc.cmdline()) + proc.name(), proc.cpu_times()
        except psutil.Error:
            continue
        role = ("front" if proc.pid == pid else "worker" if "server.worker.main" in text else "engine")
        roles[role] += times.user + times.system
    return roles


async def grpc_bench(name: str, model: Path, args, vocab: int) -> dict[str, tuple[float, dict[str, float]]]:
    """Best wall seconds of alternated top-64 / score_ids rounds through gRPC, and the server's
    CPU seconds per role in the median round of each."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from proctor.client import TeacherClient

    from support.servers import SubprocessServer

    flags = ["--engine", name, "--model", str(model), "--dtype", "float32", "--max-topk", str(K), "--no-verbose",
             "--max-model-len", str(max(2048, args.length + 1))]
    if name == "vllm":
        flags += ["--inference", f"gpu_memory_utilization={args.gpu_memory_utilization}",
                  "--inference", "enforce_eager=true"]
    server = SubprocessServer(flags, startup_timeout=600)
    rng, generator = random.Random(1), torch.Generator().manual_seed(0)
    prompt = args.length // 2 if args.prompt_length is None else args.prompt_length

    def fresh() -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(args.length)] for _ in range(args.seqs)]

    support = [torch.randint(0, vocab, (args.length - prompt, K), generator=generator, dtype=torch.int32)
               for _ in range(args.seqs)]
    phases = {
        "topk": lambda client, batch: [client.score(ids, prompt_length=prompt, topk=K, logprobs=args.logprobs)
                                       for ids in batch],
        "score_ids": lambda client, batch: [client.score(ids, prompt_length=prompt, logprobs=args.logprobs,
                                                         score_ids=s)
                                            for ids, s in zip(batch, support, strict=True)],
    }
    walls: dict[str, list[float]] = {m: [] for m in phases}
    cpus: dict[str, list[dict[str, float]]] = {m: [] for m in phases}
    try:
        async with TeacherClient(server.grpc_target, max_concurrency=args.seqs) as client:
            for calls in phases.values():  # warm-up
                await asyncio.gather(*calls(client, fresh()))
            for _ in range(args.repeat):
                for mode, calls in phases.items():
                    batch = fresh()
                    before = _server_cpu(server.proc.pid)
                    started = time.perf_counter()
                    await asyncio.gather(*calls(client, batch))
                    walls[mode].append(time.perf_counter() - started)
                    after = _server_cpu(server.proc.pid)
                    cpus[mode].append({k: after[k] - before[k] for k in after})
    finally:
        server.stop()
    out = {}
    for mode in phases:
        middle = sorted(range(len(walls[mode])), key=walls[mode].__getitem__)[len(walls[mode]) // 2]
        out[mode] = (min(walls[mode]), cpus[mode][middle])
        print(f"  {name} {mode}: walls {', '.join(f'{w:.3f}' for w in walls[mode])}", file=sys.stderr, flush=True)
    return out


def print_grpc(args, results: dict[str, dict[str, tuple[float, dict[str, float]]]]) -> None:
    rows = "L/2" if args.prompt_length is None else args.prompt_length
    asked = " + log-probs" if args.logprobs else ""
    print(f"\n{args.seqs} x {args.length} tokens sent at once over gRPC, rows from {rows}{asked}, K = {K}; best of "
          f"{args.repeat} alternated rounds; server CPU seconds of the median round by process")
    for name, r in results.items():
        (t_top, c_top), (t_ids, c_ids) = r["topk"], r["score_ids"]
        cpu = "  ".join(f"{role} {c_ids[role]:.3f}/{c_top[role]:.3f}" for role in c_top)
        print(f"{name:<6} top-{K}: {t_top:.3f}s   score_ids: {t_ids:.3f}s   score_ids/top-{K} = {t_ids / t_top:.2f}x"
              f"   CPU-s score_ids/top-{K}: {cpu}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true", help="16 x 128 tokens, the tiny teacher, one repeat")
    parser.add_argument("--grpc", action="store_true", help="through `proctor serve` and gRPC (module docstring)")
    parser.add_argument("--prompt-length", type=int, default=None, help="--grpc: first row (default L/2)")
    parser.add_argument("--logprobs", action="store_true", help="--grpc: the actual tokens' log-probs asked too")
    args = parser.parse_args()
    if args.grpc:
        with tempfile.TemporaryDirectory() as tmp:
            from proctor.server.cli.tiny_model import make_tiny_model

            model = make_tiny_model(Path(tmp) / "teacher")  # the built-in tiny teacher (vocab 512)
            results = {name: await grpc_bench(name, model, args, 512) for name in args.engines.split(",")}
        print_grpc(args, results)
        return
    if args.quick:
        args.seqs, args.length, args.repeat = min(args.seqs, 16), min(args.length, 128), 1
    with tempfile.TemporaryDirectory() as tmp:
        model = make_teacher(Path(tmp) / "teacher", args.quick)
        import json

        vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 512)
        rng = random.Random(0)
        seqs = [[rng.randrange(3, vocab) for _ in range(args.length)] for _ in range(args.seqs)]
        results = {name: await bench(name, model, args, seqs, vocab) for name in args.engines.split(",")}
    print(f"\n{args.seqs} x {args.length} tokens, K = {K} ({args.device}): teacher seconds, bytes a token sent + answered")
    for name, r in results.items():
        (t_top, s_top, a_top), (t_ids, s_ids, a_ids) = r["topk"], r["score_ids"]
        print(f"{name:<6} top-{K}: {t_top:.2f}s {s_top:.0f}+{a_top:.0f} B   score_ids: {t_ids:.2f}s "
              f"{s_ids:.0f}+{a_ids:.0f} B   time ratio score_ids/top-{K} = {t_ids / t_top:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
