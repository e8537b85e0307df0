"""Masking and reduction of per-token losses, kept apart from the losses themselves.

The modes are verl's ``agg_loss`` modes, so a loss from this package reduces
exactly as verl would reduce it. Inputs may be padded ``[B, T]`` or packed
``[N]``; packed sequence modes need ``seq_index [N]`` (which sequence each token
belongs to).
"""

from __future__ import annotations

import torch

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


def _per_sequence(x: torch.Tensor, seq_index: torch.Tensor | None) -> torch.Tensor:
    """Sum ``x`` within each sequence: rows of a ``[B, T]`` tensor or groups of ``seq_index``."""
    if x.dim() == 2:
        return x.sum(dim=-1)
    if seq_index is None:
        raise ValueError("seq_index is required to aggregate a packed [N] loss by sequence")
    if seq_index.shape != x.shape:
        raise ValueError(f"seq_index has shape {tuple(seq_index.shape)} but the loss has {tuple(x.shape)}")
    idx = seq_index.to(device=x.device, dtype=torch.long)
    size = int(idx.max()) + 1 if idx.numel() else 0
    return torch.zeros(size, dtype=x.dtype, device=x.device).index_add(0, idx, x)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor | None = None,
    mode: str = "token-mean",
    *,
    seq_index: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the tokens where ``mask`` is set.

    Masked tokens contribute nothing, to the value or to the gradient (they are
    selected out with ``where``, so even a non-finite masked loss stays out).
    ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size`` /
    ``loss_scale_factor`` mean what they mean in verl's ``agg_loss``.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
    if loss.dim() not in (1, 2):
        raise ValueError(f"loss must be [N] or [B, T], got shape {tuple(loss.shape)}")
    if mask is None:
        mask = torch.ones_like(loss, dtype=torch.bool)
    if mask.shape != loss.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but loss has {tuple(loss.shape)}")
    m = mask.to(device=loss.device).bool()
    masked = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    mf = m.to(loss.dtype)
    if mode == "token-mean":
        denom = mf.sum() if batch_num_tokens is None else batch_num_tokens
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError("batch_num_tokens is required when dp_size > 1")
        return masked.sum() / denom * dp_size
    if mode == "token-sum":
        return masked.sum() * dp_size
    seq_count = _per_sequence(mf, seq_index)
    seq_sum = _per_sequence(masked, seq_index)
    seq_valid = (seq_count > 0).to(loss.dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = seq_valid.sum()
    if mode == "seq-mean-token-mean":
        seq_sum = seq_sum / (seq_count + 1e-8)
    out = (seq_sum * seq_valid).sum() / global_batch_size * dp_size
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            if loss.dim() != 2:
                raise ValueError("loss_scale_factor is required for seq-mean-token-sum-norm on a packed loss")
            loss_scale_factor = loss.shape[-1]
        out = out / loss_scale_factor
    return out
