"""The one base of the chunked losses: a loss states its formula per token chunk, this module runs it.

A ``ChunkedLoss`` says what one token chunk of the student's logits gives (``chunk_stats``:
per-token statistics, the loss first) and what it contributes to the student gradients
(``chunk_grad``: ``Σ_rows scale · dℓ/d(logits)`` into the chunk's source, recomputing its tiles).
Everything else is here, once, for every loss:

* ``per_token``: the per-token loss ``[N]``. Its backward takes an arbitrary ``grad_output``,
  so it recomputes each token chunk from the saved statistics (all-zero chunks skipped).
* ``reduced``: ``Σ_i w_i transform(ℓ_i)`` with weights known up front, so each chunk's
  gradient is formed in the forward pass right after its statistics
  (``chunk_stats_and_grad``, which a loss overrides where the two share tiles) and the
  backward only scales the stored gradients. Its per-token output stays differentiable,
  through the same recomputing backward as ``per_token``.

Only the student is an autograd input: a loss holds its constants (teacher tensors, ids) itself,
detached. Gradients are accumulated in the compute dtype in ``[N, H]`` / ``[V, H]`` buffers
(``[N, V]`` only for given logits) and handed back in the inputs' dtypes.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from .chunking import Chunking, DenseSource, FusedSource, LogitSource, RowBlock
from .reduced import Reduced, Transform, add_grads, hand_over_grads, row_scale, transformed, weighted_total

Stats = tuple[torch.Tensor, ...]
GradFn = Callable[[torch.Tensor], None]


def student_source(
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    logits: torch.Tensor | None,
    inv_tau: float,
    dtype: torch.dtype,
    needs: tuple[bool, bool, bool] = (False, False, False),
) -> LogitSource:
    """The student's logit source: dense when ``logits`` are given, else fused.

    ``needs`` says which of ``(hidden, weight, logits)`` get a gradient accumulator.
    """
    if logits is not None:
        return DenseSource(logits, inv_tau, grad_logits=needs[2], dtype=dtype)
    assert hidden is not None and weight is not None
    return FusedSource(hidden, weight, inv_tau, grad_hidden=needs[0], grad_weight=needs[1], dtype=dtype)


class RowBuffers:
    """``[rows, V]`` buffers of one reduced pass, allocated on first use and reused by every chunk.

    A fresh whole-vocabulary block per chunk would be fresh pages to fault in and zero each time.
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = (rows, vocab), dtype, device
        self.buffers: dict[int, torch.Tensor] = {}

    def get(self, index: int, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of buffer ``index`` (contiguous)."""
        buf = self.buffers.get(index)
        if buf is None:
            buf = self.buffers[index] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return buf[:rows]


class ChunkedLoss(ABC):
    """A per-token quantity of the student's temperature-scaled logits, one token chunk at a time.

    Subclasses state the formula; ``per_token`` and ``reduced`` own the chunk loop, the autograd
    plumbing and the gradient buffers. ``num_stats`` is the length of ``chunk_stats``' tuple.
    """

    num_stats = 1

    def __init__(self, inv_tau: float, chunking: Chunking, dtype: torch.dtype) -> None:
        self.inv_tau, self.chunking, self.dtype = inv_tau, chunking, dtype

    @abstractmethod
    def chunk_stats(self, block: RowBlock) -> Stats:
        """Per-token statistics ``[rows]`` of a token chunk, the loss first; no gradient."""

    @abstractmethod
    def chunk_grad(self, block: RowBlock, stats: Stats, scale: torch.Tensor) -> None:
        """Accumulate ``Σ_rows scale · dℓ/d(logits)`` of a chunk into ``block``, from its saved stats."""

    def chunk_stats_and_grad(
        self, block: RowBlock, buffers: RowBuffers, want_grad: bool
    ) -> tuple[Stats, GradFn | None]:
        """A chunk's stats and, with ``want_grad``, the function taking ``scale`` to ``chunk_grad``.

        What the reduced pass calls; a loss whose gradient can reuse the tiles its stats were
        computed from overrides it (in ``buffers``' reused rows) to save the recomputation.
        """
        stats = self.chunk_stats(block)
        return stats, (functools.partial(self.chunk_grad, block, stats) if want_grad else None)


def _stat_buffers(loss: ChunkedLoss, src: LogitSource) -> list[torch.Tensor]:
    return [torch.empty(src.num_tokens, dtype=loss.dtype, device=src.device) for _ in range(loss.num_stats)]


def _student_grads(
    loss: ChunkedLoss, inputs: tuple, stats: list[torch.Tensor], grad: torch.Tensor, needs: tuple[bool, ...]
) -> list[torch.Tensor | None]:
    """``Σ_n grad_n · dℓ_n/d(student)`` as ``[hidden, weight, logits]``, recomputing each chunk."""
    src = student_source(*inputs, loss.inv_tau, loss.dtype, needs)
    g = grad.to(loss.dtype)
    for t0, t1 in loss.chunking.token_chunks(src.num_tokens):
        gc = g[t0:t1]
        if bool(gc.any()):  # masked chunks: nothing to add
            loss.chunk_grad(src.rows(t0, t1), tuple(x[t0:t1] for x in stats), gc)
    return src.input_grads()


class _PerToken(torch.autograd.Function):
    """The per-token form: only O(N) statistics are kept; the backward recomputes the tiles,
    because its ``grad_output`` is an arbitrary ``[N]`` vector known only then."""

    @staticmethod
    def forward(ctx, hidden, weight, logits, loss: ChunkedLoss):
        src = student_source(hidden, weight, logits, loss.inv_tau, loss.dtype)
        stats = _stat_buffers(loss, src)
        for t0, t1 in loss.chunking.token_chunks(src.num_tokens):
            for full, part in zip(stats, loss.chunk_stats(src.rows(t0, t1)), strict=True):
                full[t0:t1] = part
        ctx.save_for_backward(hidden, weight, logits, *stats)
        ctx.loss = loss
        return stats[0]

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, logits, *stats = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if not any(needs):
            return None, None, None, None
        return (*_student_grads(ctx.loss, (hidden, weight, logits), stats, grad_out, needs), None)


class _Reduced(torch.autograd.Function):
    """The reduced form: the weights are known up front, so each chunk's gradient is formed while
    its tiles are at hand and the backward only scales it (``hand_over_grads``)."""

    @staticmethod
    def forward(ctx, hidden, weight, logits, weights, loss: ChunkedLoss, transform, want: bool):
        needs = tuple(bool(x) and want for x in ctx.needs_input_grad[:3])
        src = student_source(hidden, weight, logits, loss.inv_tau, loss.dtype, needs)
        n = src.num_tokens
        w = weights.to(device=src.device, dtype=loss.dtype)
        stats, values = _stat_buffers(loss, src), torch.empty(n, dtype=loss.dtype, device=src.device)
        buffers = RowBuffers(min(loss.chunking.chunk_tokens, max(n, 1)), src.vocab, loss.dtype, src.device)
        for t0, t1 in loss.chunking.token_chunks(n):
            wc = w[t0:t1]
            part, grad_fn = loss.chunk_stats_and_grad(src.rows(t0, t1), buffers, any(needs) and bool(wc.any()))
            value, slope = transformed(part[0], transform)
            if grad_fn is not None:  # zero-weight chunks skip their gradient matmuls
                grad_fn(row_scale(wc, slope))
            del grad_fn
            for full, p in zip(stats, part, strict=True):
                full[t0:t1] = p
            values[t0:t1] = value
        del buffers
        ctx.grads = src.input_grads()
        del src
        ctx.save_for_backward(hidden, weight, logits, *stats)
        ctx.loss = loss
        ctx.set_materialize_grads(False)
        return weighted_total(values, w), stats[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total, grad_per_token):
        grads, per_token_too = hand_over_grads(ctx, grad_total, grad_per_token)
        if per_token_too:
            hidden, weight, logits, *stats = ctx.saved_tensors
            needs = ctx.needs_input_grad[:3]
            grads = add_grads(grads, _student_grads(ctx.loss, (hidden, weight, logits), stats, grad_per_token, needs))
        return (*grads, None, None, None, None)


def per_token(
    loss: ChunkedLoss, hidden: torch.Tensor | None, weight: torch.Tensor | None, logits: torch.Tensor | None
) -> torch.Tensor:
    """``loss``'s first statistic ``[N]``, differentiable in the student inputs."""
    return _PerToken.apply(hidden, weight, logits, loss)


def reduced(
    loss: ChunkedLoss,
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    logits: torch.Tensor | None,
    weights: torch.Tensor,
    transform: Transform | None,
) -> Reduced:
    """``Reduced(Σ_i weights_i · transform(ℓ_i), ℓ)`` with the gradients formed in the forward pass."""
    total, loss_per_token = _Reduced.apply(
        hidden, weight, logits, weights.detach(), loss, transform, torch.is_grad_enabled()
    )
    return Reduced(total, loss_per_token)
