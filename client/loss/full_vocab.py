"""Exact full-vocabulary KL / JSD from teacher hidden states, chunked on both sides.

The teacher's logits are rebuilt tile by tile from its hidden states and its
unembedding; the student's come either from a fused ``(hidden, weight)`` pair
(tile by tile too, so neither side's ``[N, V]`` logits nor their gradient ever
exist) or from given ``[N, V]`` logits.

Forward: per token chunk, pass 1 streams both log-sum-exps over vocabulary
tiles; the forward and reverse KL come out of that same pass as streamed
expectations. The floored forward KL and the JSD need both normalisers first, so
they take a second pass (which reuses the tiles when one tile spans the
vocabulary). Only O(N) per-token statistics are kept.

Backward: the per-token loss is usually masked and re-weighted before it is
reduced, so ``grad_output`` is an arbitrary ``[N]`` vector and a weight
gradient cannot be precomputed in forward and merely rescaled. Backward
therefore recomputes each tile, forms ``grad_output · dL/da`` from the saved
statistics and contracts it immediately into ``grad_hidden`` / ``grad_weight``.
Token chunks whose ``grad_output`` is all zero (masked) are skipped.

This module states the formula of one token chunk (``_FullVocabLoss``); the chunk
loop, the autograd plumbing and the gradient buffers of both entries are
``chunked_loss``'s, the teacher validation and multi-teacher grouping ``teachers``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Unpack

import torch

from . import _checks
from .chunked_loss import ChunkedLoss, GradFn, RowBuffers, Stats, per_token, reduced
from .chunking import Chunking, FusedSource, OnlineLogSumExp, RowBlock, compute_dtype, for_device
from .divergences import Divergence, full_rows, full_rows_sliced, make_divergence
from .options import FullVocabOptions, LossOptions, read_options
from .reduced import Reduced, Transform, check_weights
from .teachers import by_teacher, check_teachers


@dataclass(frozen=True)
class _Spec:
    divergence: Divergence
    inv_tau: float
    chunking: Chunking
    dtype: torch.dtype


class _FullVocabLoss(ChunkedLoss):
    """The divergence between the student's and one teacher's full softmax: the formula of both
    entries (``chunked_loss`` runs it); stats are ``(loss, lse_student, lse_teacher, aux)``."""

    num_stats = 4

    def __init__(self, spec: _Spec, teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor) -> None:
        super().__init__(spec.inv_tau, spec.chunking, spec.dtype)
        self.divergence = spec.divergence
        self.teacher = FusedSource(teacher_hidden, teacher_weight, spec.inv_tau, dtype=spec.dtype)

    @functools.cached_property
    def _rows(self) -> Callable:
        return _rows_function(self.divergence, self.teacher.device)

    def chunk_stats(self, block: RowBlock) -> Stats:
        """Tile by tile: pass 1 streams both normalisers (and the online side's expectation);
        the floored forward KL and the JSD take a second pass, reusing a single vocabulary tile."""
        div, ch, vocab, rows = self.divergence, self.chunking, block.vocab, block.num_rows
        tb = self.teacher.rows(block.t0, block.t1)
        online = div.online_side()
        single = ch.single_vocab_chunk(vocab)
        acc_s = OnlineLogSumExp(rows, block.src.device, online == "student", self.dtype)
        acc_t = OnlineLogSumExp(rows, block.src.device, online == "teacher", self.dtype)
        kept: tuple[torch.Tensor, torch.Tensor] | None = None
        for v0, v1 in ch.vocab_chunks(vocab):
            a, b = block.tile(v0, v1), tb.tile(v0, v1)
            acc_s.update(a, (a - b) if online == "student" else None)
            acc_t.update(b, (b - a) if online == "teacher" else None)
            if single and online is None:
                kept = (a, b)
        ls, lt = acc_s.logsumexp(), acc_t.logsumexp()
        if online is not None:
            loss = acc_t.expectation() - lt + ls if online == "teacher" else acc_s.expectation() - ls + lt
            return loss, ls, lt, div.finish_aux(loss, torch.zeros_like(loss))
        loss = torch.zeros(rows, dtype=self.dtype, device=block.src.device)
        aux = torch.zeros_like(loss)
        for v0, v1 in ch.vocab_chunks(vocab):
            a, b = kept if kept is not None else (block.tile(v0, v1), tb.tile(v0, v1))
            part_loss, part_aux = div.tile_terms(a.sub_(ls[:, None]), b.sub_(lt[:, None]))
            loss += part_loss
            aux += part_aux
        return loss, ls, lt, div.finish_aux(loss, aux)

    def chunk_grad(self, block: RowBlock, stats: Stats, scale: torch.Tensor) -> None:
        loss, ls, lt, aux = stats
        tb = self.teacher.rows(block.t0, block.t1)
        for v0, v1 in self.chunking.vocab_chunks(block.vocab):
            log_p = block.tile(v0, v1).sub_(ls[:, None])
            log_q = tb.tile(v0, v1).sub_(lt[:, None])
            block.add_grad(v0, v1, self.divergence.tile_grad(log_p, log_q, loss, aux), scale)

    def chunk_stats_and_grad(
        self, block: RowBlock, buffers: RowBuffers, want_grad: bool
    ) -> tuple[Stats, GradFn | None]:
        """With one tile spanning the vocabulary, whole rows of both sides (one matmul each) give
        normalisers, loss and gradient tile at once: 4 matmuls over ``N·H·V`` in all, the floor."""
        vocab, rows = block.vocab, block.num_rows
        if not self.chunking.single_vocab_chunk(vocab):
            return super().chunk_stats_and_grad(block, buffers, want_grad)
        a = block.tile(0, vocab, out=buffers.get(0, rows))
        b = self.teacher.rows(block.t0, block.t1).tile(0, vocab, out=buffers.get(1, rows))
        loss, ls, lt, aux, grad = self._rows(a, b, want_grad)
        if grad is None:
            return (loss, ls, lt, aux), None
        return (loss, ls, lt, aux), functools.partial(block.add_grad, 0, vocab, grad)


def _make_rows_function(div: Divergence) -> Callable:
    """``full_rows`` for one divergence, without input mutation: the function ``torch.compile`` sees."""

    def rows(a: torch.Tensor, b: torch.Tensor, want_grad: bool):
        return full_rows(div, a, b, want_grad, inplace=False)

    return rows


def _rows_function(div: Divergence, device: torch.device) -> Callable:
    """The whole-row tile function: compiled on CUDA, the in-place eager one elsewhere."""
    pure = _make_rows_function(div)
    selected = for_device(pure, device, ("full_rows", div))
    if selected is pure:
        return functools.partial(full_rows_sliced, div)
    return selected


def _prepare(
    teacher_hidden: torch.Tensor, teacher_weight, o: LossOptions, reduced: bool
) -> tuple[_Spec, list, int]:
    """Validate the arguments of both entries; return ``(spec, teacher weights, N)``."""
    _checks.check_options(o.direction, o.beta, o.temperature, o.log_prob_min_clamp, o.chunk_tokens)
    _checks.check_chunk("chunk_vocab", o.chunk_vocab)
    _checks.require_2d("teacher_hidden", teacher_hidden)
    n, vocab = _checks.check_student(*o.student, teacher_hidden.shape[0])
    weights = check_teachers(teacher_hidden, teacher_weight, o.teacher_index, vocab)
    if reduced:
        chunking = Chunking.resolve_rows(n, vocab, o.chunk_tokens, o.chunk_vocab, teacher_hidden.device)
    else:
        chunking = Chunking.resolve(n, vocab, o.chunk_tokens, o.chunk_vocab)
    spec = _Spec(
        make_divergence(o.direction, o.beta, o.log_prob_min_clamp),
        1.0 / float(o.temperature),
        chunking,
        compute_dtype(*o.student, teacher_hidden),
    )
    if o.teacher_index is None and weights[0] is None:
        raise ValueError("teacher_weight is None: the teacher has no unembedding")
    return spec, weights, n


def full_vocab_kl(
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor | Sequence[torch.Tensor | None],
    **options: Unpack[FullVocabOptions],
) -> torch.Tensor:
    """Exact per-token divergence over the whole vocabulary, as a float32 ``[N]`` tensor
    (float64 when the inputs are float64).

    ``direction``: ``"forward"`` KL(p_T‖p_S), ``"reverse"`` KL(p_S‖p_T) or ``"jsd"``
    (generalised JSD with ``beta``; 0 → forward, 1 → reverse). ``temperature``
    divides both sides' logits. ``log_prob_min_clamp`` floors log p_S in the
    forward KL, and the gradient is the floored loss's gradient.

    Multi-teacher: pass ``teacher_weight`` as a sequence (one ``[V, H_j]`` per
    teacher, ``None`` for a teacher without an unembedding) and ``teacher_index
    [N]``; token n then uses ``teacher_hidden[n, :H_j]`` with weight ``j``. Tokens
    are grouped by teacher, so each group runs one chunked pass.

    The teacher is a constant: no gradient flows to ``teacher_hidden`` or
    ``teacher_weight``. When the per-token loss is going to be reduced with weights
    known now (a mask and an aggregation mode), ``full_vocab_kl_reduced`` costs 4
    matmuls over ``N·H·V`` instead of this function's 6 or more.
    """
    o = read_options(FullVocabOptions, options, "full_vocab_kl")
    spec, weights, _ = _prepare(teacher_hidden, teacher_weight, o, reduced=False)

    def run(sub_student, th, tw, rows):
        return per_token(_FullVocabLoss(spec, th, tw), *sub_student), None

    loss, _ = by_teacher(teacher_hidden.detach(), weights, o.teacher_index, o.student, run, spec.dtype)
    return loss


def full_vocab_kl_reduced(
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor | Sequence[torch.Tensor | None],
    weights: torch.Tensor,
    *,
    transform: Transform | None = None,
    **options: Unpack[FullVocabOptions],
) -> Reduced:
    """``Σ_i weights_i · transform(ℓ_i)`` of ``full_vocab_kl``'s per-token loss ``ℓ``, at the matmul floor.

    ``weights`` (float ``[N]``, e.g. ``aggregate_weights(mask, mode)``) are constants known
    before the forward pass, which therefore forms the student gradients tile by tile and
    leaves the backward a scalar multiplication: 4 matmuls over ``N·H·V`` against the
    per-token path's 6 (8 for the floored forward KL and the JSD). Token chunks are whole
    vocabulary rows (``chunk_tokens`` rows; by default as many as fit a fixed element budget,
    so memory is independent of N). A ``chunk_vocab`` below V bounds memory further but
    recomputes each tile (6 matmuls). Zero-weight chunks skip their gradient matmuls.

    Returns ``Reduced(total, per_token)``; the other arguments are ``full_vocab_kl``'s. The
    stored gradients are handed to autograd in the backward, so ``total`` can be
    backpropagated once.
    """
    o = read_options(FullVocabOptions, options, "full_vocab_kl_reduced")
    spec, t_weights, n = _prepare(teacher_hidden, teacher_weight, o, reduced=True)
    check_weights(weights, n)
    w_all = weights.detach()

    def run(sub_student, th, tw, rows):
        w = w_all if rows is None else w_all.index_select(0, rows.to(w_all.device))
        total, loss = reduced(_FullVocabLoss(spec, th, tw), *sub_student, w, transform)
        return loss, total

    loss, total = by_teacher(teacher_hidden.detach(), t_weights, o.teacher_index, o.student, run, spec.dtype)
    return Reduced(total, loss)

