"""Masking and reduction of per-token losses, kept apart from the losses themselves.

The modes are verl's ``agg_loss`` modes, so a loss from this package reduces
exactly as verl would reduce it. Inputs may be padded ``[B, T]`` or packed
``[N]``; packed sequence modes need ``seq_index [N]`` (which sequence each token
belongs to).
"""

from __future__ import annotations

from typing import Unpack

import torch

from .options import AggregateOptions, check_keys

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


def aggregate_weights(
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    dtype: torch.dtype = torch.float32,
    **options: Unpack[AggregateOptions],
) -> torch.Tensor:
    """Per-token weights ``w`` (the mask's shape) with ``aggregate(loss, mask, mode, ...) = Σ w · loss``.

    Every mode is linear in the per-token loss once the mask is known, so the
    weights exist before the loss does: the reduced losses take them to form
    their gradients in the forward pass. Masked tokens weigh 0. Where
    ``aggregate`` divides by zero (no valid token or sequence) the weights are
    not finite, as ``aggregate``'s value is NaN there.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
    check_keys(AggregateOptions, options, "aggregate_weights")
    seq_index, dp_size = options.get("seq_index"), options.get("dp_size", 1)
    batch_num_tokens, global_batch_size = options.get("batch_num_tokens"), options.get("global_batch_size")
    loss_scale_factor = options.get("loss_scale_factor")
    if mask.dim() not in (1, 2):
        raise ValueError(f"mask must be [N] or [B, T], got shape {tuple(mask.shape)}")
    mf = mask.bool().to(dtype)
    if mode == "token-mean":
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError("batch_num_tokens is required when dp_size > 1")
        denom = mf.sum() if batch_num_tokens is None else batch_num_tokens
        return mf / denom * dp_size
    if mode == "token-sum":
        return mf * dp_size
    seq_count = _per_sequence(mf, seq_index)
    seq_valid = (seq_count > 0).to(dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = seq_valid.sum()
    per_seq = seq_valid / global_batch_size * dp_size
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (seq_count + 1e-8)
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            if mask.dim() != 2:
                raise ValueError("loss_scale_factor is required for seq-mean-token-sum-norm on a packed loss")
            loss_scale_factor = mask.shape[-1]
        per_seq = per_seq / loss_scale_factor
    if mask.dim() == 2:
        return mf * per_seq[:, None]
    return mf * per_seq[seq_index.to(device=mf.device, dtype=torch.long)]


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor | None = None,
    mode: str = "token-mean",
    **options: Unpack[AggregateOptions],
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the tokens where ``mask`` is set.

    Masked tokens contribute nothing, to the value or to the gradient (they are
    selected out with ``where``, so even a non-finite masked loss stays out).
    ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size`` /
    ``loss_scale_factor`` mean what they mean in verl's ``agg_loss``. The
    reduction is ``Σ aggregate_weights(mask, mode, ...) · loss``: one statement
    of the modes for this function and for the reduced losses.
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
    weights = aggregate_weights(m, mode, dtype=loss.dtype, **options)
    masked = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    return (masked * weights).sum()
