"""Logging statistics of a per-token loss over the valid tokens.

Kept separate from the losses: metrics never take part in the gradient, and a
trainer logs them at its own cadence.
"""

from __future__ import annotations

import torch


def loss_metrics(
    loss: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    student_mass: torch.Tensor | None = None,
    teacher_mass: torch.Tensor | None = None,
) -> dict[str, float]:
    """``loss`` (mean), ``loss_min``, ``loss_max`` over valid tokens, plus top-k masses when given.

    ``student_mass`` / ``teacher_mass`` are per-token top-k masses (see
    ``topk_masses``); their means over valid tokens are reported. With no valid
    token the values are NaN rather than an error, so a fully padded micro-batch
    does not stop training.
    """
    with torch.no_grad():
        valid = torch.ones_like(loss, dtype=torch.bool) if mask is None else mask.to(loss.device).bool()
        if valid.shape != loss.shape:
            raise ValueError(f"mask has shape {tuple(valid.shape)} but loss has {tuple(loss.shape)}")
        vals = loss.detach().float()[valid]
        nan = float("nan")
        out = {
            "loss": vals.mean().item() if vals.numel() else nan,
            "loss_min": vals.min().item() if vals.numel() else nan,
            "loss_max": vals.max().item() if vals.numel() else nan,
        }
        for name, mass in (("student_mass", student_mass), ("teacher_mass", teacher_mass)):
            if mass is None:
                continue
            if mass.shape != loss.shape:
                raise ValueError(f"{name} has shape {tuple(mass.shape)} but loss has {tuple(loss.shape)}")
            m = mass.detach().float()[valid]
            out[name] = m.mean().item() if m.numel() else nan
    return out
