"""Two chunked, differentiable student-side primitives that the top-k losses compose.

* ``student_logsumexp``: the full-vocabulary log-normaliser of the student's
  temperature-scaled logits, streamed over tiles (a ``ChunkedLoss``); its backward
  recomputes each tile and contracts ``grad · softmax`` straight into
  ``grad_hidden`` / ``grad_weight``.
* ``student_logits_at``: the scaled logits at given ids ``[N, K]``; with a fused
  student this is a row-wise dot product with gathered weight rows, done in
  token sub-chunks so the gathered ``[rows, K, H]`` block stays within budget.

With both, ``log p_S(id) = logits_at(id) - logsumexp`` is exact and autograd only
ever sees ``[N]`` and ``[N, K]`` tensors.
"""

from __future__ import annotations

import torch

from .chunked_loss import ChunkedLoss, Stats, per_token
from .chunking import DEFAULT_TILE_ELEMENTS, Chunking, RowBlock, compute_dtype, stream_logsumexp


class _LogSumExp(ChunkedLoss):
    """The student's full-vocabulary log-normaliser, streamed over tiles; ``d lse / d a = softmax(a)``."""

    def chunk_stats(self, block: RowBlock) -> Stats:
        return (stream_logsumexp(block, block.num_rows, block.vocab, self.chunking, block.src.device, self.dtype),)

    def chunk_grad(self, block: RowBlock, stats: Stats, scale: torch.Tensor) -> None:
        (lse,) = stats
        for v0, v1 in self.chunking.vocab_chunks(block.vocab):
            p = block.tile(v0, v1).sub_(lse[:, None]).exp_()
            block.add_grad(v0, v1, p.mul_(scale[:, None]))


def student_logsumexp(
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    logits: torch.Tensor | None,
    inv_tau: float,
    chunking: Chunking,
) -> torch.Tensor:
    """``[N]`` log-sum-exp (float32; float64 for float64 inputs) of the scaled student logits; differentiable."""
    return per_token(_LogSumExp(inv_tau, chunking, compute_dtype(hidden, weight, logits)), hidden, weight, logits)


class _FusedLogitsAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, inv_tau: float):
        n, k = ids.shape
        h_dim = hidden.shape[1]
        dtype = compute_dtype(hidden, weight)
        out = torch.empty(n, k, dtype=dtype, device=hidden.device)
        step = _rows_per_gather(k, h_dim)
        for t0 in range(0, n, step):
            t1 = min(t0 + step, n)
            w_rows = weight[ids[t0:t1]].to(dtype)  # [rows, K, H]
            h = hidden[t0:t1].to(dtype).unsqueeze(2)  # [rows, H, 1]
            out[t0:t1] = torch.bmm(w_rows, h).squeeze(2)
        if inv_tau != 1.0:
            out.mul_(inv_tau)
        ctx.save_for_backward(hidden, weight, ids)
        ctx.inv_tau = inv_tau
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, ids = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        dtype = compute_dtype(hidden, weight)
        g = grad_out.to(dtype) * ctx.inv_tau  # [N, K]
        n, k = ids.shape
        h_dim = hidden.shape[1]
        grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        step = _rows_per_gather(k, h_dim)
        for t0 in range(0, n, step):
            t1 = min(t0 + step, n)
            gc = g[t0:t1]
            if grad_h is not None:
                w_rows = weight[ids[t0:t1]].to(dtype)  # [rows, K, H]
                grad_h[t0:t1] = torch.bmm(gc.unsqueeze(1), w_rows).squeeze(1)
            if grad_w is not None:
                contrib = gc.unsqueeze(2) * hidden[t0:t1].to(dtype).unsqueeze(1)  # [rows, K, H]
                grad_w.index_add_(0, ids[t0:t1].reshape(-1), contrib.reshape(-1, h_dim))
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            None,
            None,
        )


def _rows_per_gather(k: int, h_dim: int) -> int:
    """Token rows per gathered ``[rows, K, H]`` block, within the tile budget."""
    return max(1, DEFAULT_TILE_ELEMENTS // max(1, k * h_dim))


def student_logits_at(
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    logits: torch.Tensor | None,
    ids: torch.Tensor,
    inv_tau: float,
) -> torch.Tensor:
    """``[N, K]`` scaled student logits (float32; float64 for float64 inputs) at ``ids``; differentiable."""
    ids = ids.to(torch.long)
    if logits is not None:
        out = logits.gather(1, ids).to(compute_dtype(logits))
        return out * inv_tau if inv_tau != 1.0 else out
    return _FusedLogitsAt.apply(hidden, weight, ids, inv_tau)
