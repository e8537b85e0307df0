"""A copy of a model directory whose weights differ from the original's by noise of a given size:
a replica with wrongly loaded or corrupted weights, for the drift check and `proctor verify`."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def perturbed_copy(model_dir: Path | str, out_dir: Path | str, *, scale: float = 1e-3, seed: int = 0) -> Path:
    """`model_dir` copied to `out_dir`, every floating-point weight plus `scale` x N(0, 1) noise."""
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for path in out.glob("*.safetensors"):
        weights = load_file(path)
        noisy = {name: w + scale * torch.randn(w.shape, generator=generator, dtype=w.dtype) if w.is_floating_point()
                 else w for name, w in weights.items()}
        save_file(noisy, path, metadata={"format": "pt"})
    return out
