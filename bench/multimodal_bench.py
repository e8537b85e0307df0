"""Image+text sequences vs text-only sequences of the same length, per engine, one run.

The tiny Qwen2.5-Omni Thinker (or `--model`, any Thinker/VL checkpoint) scores N sequences of
about L tokens twice, interleaved: with two images each (their placeholder runs inside the L
tokens) and as plain text of exactly the same token count. Printed per engine: tokens/s of
each, their ratio, and the CPU seconds per 1k tokens of the whole process tree (EngineCore
included), the side-by-side numbers that do not depend on how busy the machine is. What the
ratio shows is the media's own cost: the processor (resize, patches), the vision tower and the
M-RoPE positions, over the same language-model work.

    .venv/bin/python bench/multimodal_bench.py [--engines torch,vllm] [--n 16] [--length 256]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"


def _png(rng: np.random.Generator, height: int, width: int):
    from PIL import Image

    from proctor.server.engines.base import MediaItem

    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return MediaItem(buffer.getvalue(), "image/png")


def workload(model: Path, n: int, length: int):
    """(media requests, text requests) of equal token counts, as EngineRequests, and the image
    tokens a media request holds."""
    import torch
    from transformers import AutoProcessor

    from proctor.server.engines.base import EngineRequest, MultiModalInputs
    from proctor.server.engines.media import decode_media

    processor = AutoProcessor.from_pretrained(model)
    rng = np.random.default_rng(0)
    media_requests, text_requests = [], []
    for index in range(n):
        items = (_png(rng, 84, 112), _png(rng, 112, 84))
        decoded = decode_media(MultiModalInputs(images=items))
        head = processor(text=[f"User: {IMAGE} and {IMAGE}"], images=decoded.decoded["image"])["input_ids"][0]
        filler = rng.integers(20, 400, max(length - len(head), 8)).tolist()
        ids = torch.tensor([*head, *filler])
        text = torch.tensor(rng.integers(20, 400, len(ids)).tolist())
        half = len(ids) // 2
        media_requests.append(EngineRequest(f"m{index}", ids, half, True, 8, False, media=decoded))
        text_requests.append(EngineRequest(f"t{index}", text, half, True, 8, False))
    image_token = processor.tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    image_tokens = int(sum(int((r.token_ids == image_token).sum()) for r in media_requests)) // n
    return media_requests, text_requests, image_tokens


def tree_cpu() -> float:
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


async def measure(engine, requests, repeat: int) -> tuple[float, float]:
    """(tokens per wall second, CPU seconds per 1k tokens), best wall of `repeat`."""
    tokens = sum(r.num_tokens for r in requests)
    best, cpu = float("inf"), float("inf")
    for _ in range(repeat):
        cpu0, t0 = tree_cpu(), time.perf_counter()
        outcomes = await engine.score(requests)
        wall, used = time.perf_counter() - t0, tree_cpu() - cpu0
        bad = [o for o in outcomes if not hasattr(o, "logprobs")]
        if bad:
            raise SystemExit(f"a request failed: {bad[0]}")
        best, cpu = min(best, wall), min(cpu, used)
    return tokens / best, 1000 * cpu / tokens


async def bench(name: str, model: Path, args) -> None:
    from proctor.server.engines.base import EngineSpec
    from proctor.server.engines.factory import create_engine

    inference = {"max_model_len": 2048}
    if name == "vllm":
        inference.update(gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True)
    engine = create_engine(EngineSpec(name=name, model_path=str(model), device=args.device, dtype=args.dtype,
                                      max_topk=8, inference=inference, hidden_states=False))
    await engine.start()
    try:
        media, text, image_tokens = workload(model, args.n, args.length)
        warm = await engine.score(media[:2] + text[:2])  # warm-up: compile paths, processor caches
        SCORED[name] = [o.logprobs for o in warm[:2]]
        rates: dict[str, list[tuple[float, float]]] = {"media": [], "text": []}
        for _ in range(args.rounds):  # interleaved, so drift in machine load hits both alike
            rates["text"].append(await measure(engine, text, 1))
            rates["media"].append(await measure(engine, media, 1))
        tok_text = max(r[0] for r in rates["text"])
        tok_media = max(r[0] for r in rates["media"])
        cpu_text = min(r[1] for r in rates["text"])
        cpu_media = min(r[1] for r in rates["media"])
        tokens = sum(r.num_tokens for r in media)
        print(f"{name:5s}  {args.n} x ~{tokens // args.n} tokens (2 images each, "
              f"{image_tokens} image tokens):  "
              f"text {tok_text:8.0f} tok/s  image+text {tok_media:8.0f} tok/s  ratio {tok_media / tok_text:.2f}  |  "
              f"CPU s/1k tok: text {cpu_text:.3f}  image+text {cpu_media:.3f}  ratio {cpu_media / cpu_text:.2f}")
    finally:
        await engine.close()


SCORED: dict[str, list] = {}  # each engine's log-probs of the first two media requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--model", type=Path, default=None, help="a Thinker / VL checkpoint (default: the tiny Thinker)")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.12)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model
        if model is None:
            from proctor.server.cli.tiny_multimodal import make_tiny_omni_thinker

            model = make_tiny_omni_thinker(Path(folder) / "thinker")
        for name in args.engines.split(","):
            asyncio.run(bench(name.strip(), model, args))
    if len(SCORED) == 2:  # the engines agree on the image+text sequences
        first, second = SCORED.values()
        worst = max(float((a - b).abs().max()) for a, b in zip(first, second, strict=True))
        print(f"{' vs '.join(SCORED)} on image+text: max |d logprob| {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
