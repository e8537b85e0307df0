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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from . import _checks
from .chunking import Chunking, DenseSource, FusedSource, OnlineLogSumExp, RowBlock, compute_dtype, for_device
from .divergences import Divergence, full_rows, full_rows_sliced, make_divergence
from .reduced import (
    Reduced,
    Transform,
    add_grads,
    check_weights,
    hand_over_grads,
    row_scale,
    transformed,
    weighted_total,
)


@dataclass(frozen=True)
class _Spec:
    divergence: Divergence
    inv_tau: float
    chunking: Chunking
    dtype: torch.dtype


def _student_source(
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    logits: torch.Tensor | None,
    spec: _Spec,
    needs_grad: tuple[bool, bool, bool] = (False, False, False),
) -> FusedSource | DenseSource:
    if logits is not None:
        return DenseSource(logits, spec.inv_tau, grad_logits=needs_grad[2], dtype=spec.dtype)
    assert hidden is not None and weight is not None
    return FusedSource(
        hidden, weight, spec.inv_tau, grad_hidden=needs_grad[0], grad_weight=needs_grad[1], dtype=spec.dtype,
    )


def _chunk_stats(
    sb: RowBlock, tb: RowBlock, rows: int, vocab: int, spec: _Spec, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(loss, lse_student, lse_teacher, aux)`` of one token chunk, tile by tile."""
    div, ch = spec.divergence, spec.chunking
    online = div.online_side()
    single = ch.single_vocab_chunk(vocab)
    acc_s = OnlineLogSumExp(rows, dev, online == "student", spec.dtype)
    acc_t = OnlineLogSumExp(rows, dev, online == "teacher", spec.dtype)
    kept: tuple[torch.Tensor, torch.Tensor] | None = None
    for v0, v1 in ch.vocab_chunks(vocab):
        a, b = sb.tile(v0, v1), tb.tile(v0, v1)
        acc_s.update(a, (a - b) if online == "student" else None)
        acc_t.update(b, (b - a) if online == "teacher" else None)
        if single and online is None:
            kept = (a, b)
    ls, lt = acc_s.logsumexp(), acc_t.logsumexp()
    if online is not None:
        chunk_loss = acc_t.expectation() - lt + ls if online == "teacher" else acc_s.expectation() - ls + lt
        chunk_aux = torch.zeros_like(chunk_loss)
    else:
        chunk_loss = torch.zeros(rows, dtype=spec.dtype, device=dev)
        chunk_aux = torch.zeros_like(chunk_loss)
        for v0, v1 in ch.vocab_chunks(vocab):
            a, b = kept if kept is not None else (sb.tile(v0, v1), tb.tile(v0, v1))
            part_loss, part_aux = div.tile_terms(a.sub_(ls[:, None]), b.sub_(lt[:, None]))
            chunk_loss += part_loss
            chunk_aux += part_aux
    return chunk_loss, ls, lt, div.finish_aux(chunk_loss, chunk_aux)


def _chunk_grads(
    sb: RowBlock,
    tb: RowBlock,
    vocab: int,
    spec: _Spec,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    row_scale: torch.Tensor,
) -> None:
    """Accumulate ``Σ_rows row_scale · dL/d(student)`` of one token chunk, recomputing its tiles."""
    loss, ls, lt, aux = stats
    for v0, v1 in spec.chunking.vocab_chunks(vocab):
        log_p = sb.tile(v0, v1).sub_(ls[:, None])
        log_q = tb.tile(v0, v1).sub_(lt[:, None])
        sb.add_grad(v0, v1, spec.divergence.tile_grad(log_p, log_q, loss, aux), row_scale)


def _forward_stats(
    student: FusedSource | DenseSource, teacher: FusedSource, spec: _Spec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(loss, lse_student, lse_teacher, aux)`` without any ``[N, V]`` tensor."""
    n, vocab = student.num_tokens, student.vocab
    dev = teacher.hidden.device
    out = [torch.empty(n, dtype=spec.dtype, device=dev) for _ in range(4)]
    for t0, t1 in spec.chunking.token_chunks(n):
        chunk = _chunk_stats(student.rows(t0, t1), teacher.rows(t0, t1), t1 - t0, vocab, spec, dev)
        for full, part in zip(out, chunk, strict=True):
            full[t0:t1] = part
    return out[0], out[1], out[2], out[3]


def _backward_grads(
    student: FusedSource | DenseSource,
    teacher: FusedSource,
    spec: _Spec,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    grad_out: torch.Tensor,
) -> None:
    """Accumulate ``Σ_n grad_out_n · dL_n/d(student)`` into the student source's buffers."""
    for t0, t1 in spec.chunking.token_chunks(student.num_tokens):
        g = grad_out[t0:t1]
        if not bool(g.any()):
            continue
        chunk = tuple(x[t0:t1] for x in stats)
        _chunk_grads(student.rows(t0, t1), teacher.rows(t0, t1), student.vocab, spec, chunk, g)


def _returned_grads(
    student: FusedSource | DenseSource,
    s_hidden: torch.Tensor | None,
    s_weight: torch.Tensor | None,
    s_logits: torch.Tensor | None,
) -> list:
    """The student source's accumulators, cast to the inputs' dtypes: ``[hidden, weight, logits]``."""
    if isinstance(student, DenseSource):
        gl = student.grad_logits
        return [None, None, gl.to(s_logits.dtype) if gl is not None else None]
    gh, gw = student.grad_hidden, student.grad_weight
    return [gh.to(s_hidden.dtype) if gh is not None else None, gw.to(s_weight.dtype) if gw is not None else None, None]


class _FullVocabFunction(torch.autograd.Function):
    """Per-token full-vocabulary divergence; differentiable in the student inputs only."""

    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_logits, t_hidden, t_weight, spec: _Spec):
        student = _student_source(s_hidden, s_weight, s_logits, spec)
        teacher = FusedSource(t_hidden, t_weight, spec.inv_tau, dtype=spec.dtype)
        loss, lse_s, lse_t, aux = _forward_stats(student, teacher, spec)
        ctx.save_for_backward(s_hidden, s_weight, s_logits, t_hidden, t_weight, loss, lse_s, lse_t, aux)
        ctx.spec = spec
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        s_hidden, s_weight, s_logits, t_hidden, t_weight, loss, lse_s, lse_t, aux = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if not any(needs):
            return None, None, None, None, None, None
        spec: _Spec = ctx.spec
        student = _student_source(s_hidden, s_weight, s_logits, spec, needs)
        teacher = FusedSource(t_hidden, t_weight, spec.inv_tau, dtype=spec.dtype)
        _backward_grads(student, teacher, spec, (loss, lse_s, lse_t, aux), grad_out.to(spec.dtype))
        return (*_returned_grads(student, s_hidden, s_weight, s_logits), None, None, None)


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


def _row_buffers(spec: _Spec, num_tokens: int, vocab: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's and the teacher's ``[chunk_tokens, V]`` row buffers, reused by every token chunk."""
    rows = min(spec.chunking.chunk_tokens, max(num_tokens, 1))
    return (torch.empty(rows, vocab, dtype=spec.dtype, device=dev),
            torch.empty(rows, vocab, dtype=spec.dtype, device=dev))


class _ReducedFullVocabFunction(torch.autograd.Function):
    """``Σ_i w_i transform(ℓ_i)`` with the student gradients formed in the forward pass.

    Each token chunk takes whole-vocabulary rows of both sides' logits (one matmul each),
    builds its normalisers, loss and gradient tile from them, and contracts the tile at once
    into ``grad_hidden`` / ``grad_weight`` (two more): 4 matmuls over ``N·H·V`` in all, the
    floor. The backward multiplies the stored gradients by ``grad_output``. The per-token
    output is differentiable too, through the per-token path's recomputing backward.
    """

    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_logits, t_hidden, t_weight, weights, spec: _Spec, transform, want):
        needs = tuple(bool(x) and want for x in ctx.needs_input_grad[:3])
        student = _student_source(s_hidden, s_weight, s_logits, spec, needs)
        teacher = FusedSource(t_hidden, t_weight, spec.inv_tau, dtype=spec.dtype)
        n, vocab, dev = student.num_tokens, student.vocab, t_hidden.device
        w = weights.to(device=dev, dtype=spec.dtype)
        stats = [torch.empty(n, dtype=spec.dtype, device=dev) for _ in range(4)]
        values = torch.empty(n, dtype=spec.dtype, device=dev)
        rows_fn = _rows_function(spec.divergence, dev) if spec.chunking.single_vocab_chunk(vocab) else None
        # Whole-vocabulary rows of both sides land in two buffers allocated once: a fresh
        # [rows, V] pair per chunk would be fresh pages to fault in and zero every chunk.
        bufs = _row_buffers(spec, n, vocab, dev) if rows_fn is not None else None
        for t0, t1 in spec.chunking.token_chunks(n):
            sb, tb, wc = student.rows(t0, t1), teacher.rows(t0, t1), w[t0:t1]
            grad_here = any(needs) and bool(wc.any())
            grad = None
            if bufs is not None:
                a = sb.tile(0, vocab, out=bufs[0][: t1 - t0])
                loss, ls, lt, aux, grad = rows_fn(a, tb.tile(0, vocab, out=bufs[1][: t1 - t0]), grad_here)
            else:
                loss, ls, lt, aux = _chunk_stats(sb, tb, t1 - t0, vocab, spec, dev)
            value, slope = transformed(loss, transform)
            if grad_here:
                scale = row_scale(wc, slope)
                if grad is not None:
                    sb.add_grad(0, vocab, grad, scale)
                else:
                    _chunk_grads(sb, tb, vocab, spec, (loss, ls, lt, aux), scale)
            del grad
            for full, part in zip(stats, (loss, ls, lt, aux), strict=True):
                full[t0:t1] = part
            values[t0:t1] = value
        del bufs
        ctx.grads = _returned_grads(student, s_hidden, s_weight, s_logits)
        del student
        ctx.save_for_backward(s_hidden, s_weight, s_logits, t_hidden, t_weight, *stats)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return weighted_total(values, w), stats[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total, grad_per_token):
        grads, per_token_too = hand_over_grads(ctx, grad_total, grad_per_token)
        needs = ctx.needs_input_grad[:3]
        if per_token_too:
            s_hidden, s_weight, s_logits, t_hidden, t_weight, *stats = ctx.saved_tensors
            spec: _Spec = ctx.spec
            student = _student_source(s_hidden, s_weight, s_logits, spec, needs)
            teacher = FusedSource(t_hidden, t_weight, spec.inv_tau, dtype=spec.dtype)
            _backward_grads(student, teacher, spec, tuple(stats), grad_per_token.to(spec.dtype))
            grads = add_grads(grads, _returned_grads(student, s_hidden, s_weight, s_logits))
        return (*grads, None, None, None, None, None, None)


def _check_teacher(teacher_hidden: torch.Tensor, teacher_weight, teacher_index, vocab: int) -> list:
    """Validate the teacher side; return the list of per-teacher weights."""
    _checks.require_2d("teacher_hidden", teacher_hidden)
    _checks.require_float("teacher_hidden", teacher_hidden)
    weights = list(teacher_weight) if isinstance(teacher_weight, Sequence) else [teacher_weight]
    if teacher_index is None and len(weights) != 1:
        raise ValueError("teacher_index is required when teacher_weight lists several teachers")
    if not weights:
        raise ValueError("teacher_weight is empty")
    for j, w in enumerate(weights):
        if w is None:
            continue
        name = "teacher_weight" if len(weights) == 1 else f"teacher_weight[{j}]"
        _checks.require_2d(name, w)
        _checks.require_float(name, w)
        if w.shape[0] != vocab:
            raise ValueError(f"{name} has vocabulary {w.shape[0]} but the student has {vocab}")
        if w.shape[1] > teacher_hidden.shape[1]:
            raise ValueError(
                f"{name} has hidden size {w.shape[1]} but teacher_hidden has only {teacher_hidden.shape[1]}"
            )
        if len(weights) == 1 and w.shape[1] != teacher_hidden.shape[1]:
            raise ValueError(
                f"teacher_hidden has hidden size {teacher_hidden.shape[1]} but teacher_weight has {w.shape[1]}"
            )
    return weights


def _prepare(
    teacher_hidden: torch.Tensor,
    teacher_weight,
    student_hidden: torch.Tensor | None,
    student_weight: torch.Tensor | None,
    student_logits: torch.Tensor | None,
    direction: str,
    beta: float,
    temperature: float,
    log_prob_min_clamp: float | None,
    chunk_tokens: int | None,
    chunk_vocab: int | None,
    teacher_index: torch.Tensor | None,
    reduced: bool,
) -> tuple[_Spec, list, int]:
    """Validate the arguments of both entries; return ``(spec, teacher weights, N)``."""
    _checks.check_direction(direction, beta)
    _checks.check_temperature(temperature)
    _checks.check_clamp(log_prob_min_clamp, direction)
    _checks.check_chunk("chunk_tokens", chunk_tokens)
    _checks.check_chunk("chunk_vocab", chunk_vocab)
    _checks.require_2d("teacher_hidden", teacher_hidden)
    n, vocab = _checks.check_student(student_hidden, student_weight, student_logits, teacher_hidden.shape[0])
    weights = _check_teacher(teacher_hidden, teacher_weight, teacher_index, vocab)
    if reduced:
        chunking = Chunking.resolve_rows(n, vocab, chunk_tokens, chunk_vocab, teacher_hidden.device)
    else:
        chunking = Chunking.resolve(n, vocab, chunk_tokens, chunk_vocab)
    spec = _Spec(
        make_divergence(direction, beta, log_prob_min_clamp),
        1.0 / float(temperature),
        chunking,
        compute_dtype(student_hidden, student_weight, student_logits, teacher_hidden),
    )
    if teacher_index is None and weights[0] is None:
        raise ValueError("teacher_weight is None: the teacher has no unembedding")
    return spec, weights, n


def full_vocab_kl(
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor | Sequence[torch.Tensor | None],
    *,
    student_hidden: torch.Tensor | None = None,
    student_weight: torch.Tensor | None = None,
    student_logits: torch.Tensor | None = None,
    direction: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    log_prob_min_clamp: float | None = None,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    teacher_index: torch.Tensor | None = None,
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
    spec, weights, _ = _prepare(
        teacher_hidden, teacher_weight, student_hidden, student_weight, student_logits, direction, beta,
        temperature, log_prob_min_clamp, chunk_tokens, chunk_vocab, teacher_index, reduced=False,
    )
    student = (student_hidden, student_weight, student_logits)

    def run(sub_student, th, tw, rows):
        return _FullVocabFunction.apply(*sub_student, th, tw, spec), None

    per_token, _ = _by_teacher(teacher_hidden.detach(), weights, teacher_index, student, run, spec.dtype)
    return per_token


def full_vocab_kl_reduced(
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor | Sequence[torch.Tensor | None],
    weights: torch.Tensor,
    *,
    student_hidden: torch.Tensor | None = None,
    student_weight: torch.Tensor | None = None,
    student_logits: torch.Tensor | None = None,
    direction: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    log_prob_min_clamp: float | None = None,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    teacher_index: torch.Tensor | None = None,
    transform: Transform | None = None,
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
    spec, t_weights, n = _prepare(
        teacher_hidden, teacher_weight, student_hidden, student_weight, student_logits, direction, beta,
        temperature, log_prob_min_clamp, chunk_tokens, chunk_vocab, teacher_index, reduced=True,
    )
    check_weights(weights, n)
    want = torch.is_grad_enabled()
    w_all = weights.detach()
    student = (student_hidden, student_weight, student_logits)

    def run(sub_student, th, tw, rows):
        w = w_all if rows is None else w_all.index_select(0, rows.to(w_all.device))
        total, per_token = _ReducedFullVocabFunction.apply(*sub_student, th, tw, w, spec, transform, want)
        return per_token, total

    per_token, total = _by_teacher(teacher_hidden.detach(), t_weights, teacher_index, student, run, spec.dtype)
    return Reduced(total, per_token)


def _by_teacher(
    t_hidden: torch.Tensor,
    weights: list,
    teacher_index: torch.Tensor | None,
    student: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    run: Callable,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``run(student, teacher_hidden, teacher_weight, rows)`` once (rows None), or once per teacher group.

    Multi-teacher: tokens are grouped by teacher, each group runs one chunked pass, the
    per-token losses are scattered back and the reduced totals (if any) summed.
    """
    if teacher_index is None:
        return run(student, t_hidden, weights[0].detach(), None)
    n = t_hidden.shape[0]
    if not isinstance(teacher_index, torch.Tensor) or teacher_index.shape != (n,):
        shape = tuple(teacher_index.shape) if isinstance(teacher_index, torch.Tensor) else None
        raise ValueError(f"teacher_index must be a tensor of shape ({n},), got {shape}")
    _checks.check_ids("teacher_index", teacher_index, len(weights))
    index = teacher_index.to(device=t_hidden.device, dtype=torch.long)
    student_hidden, student_weight, student_logits = student
    out = torch.zeros(n, dtype=dtype, device=t_hidden.device)
    pieces, total = [], None
    for j in torch.unique(index).tolist():
        w = weights[j]
        if w is None:
            raise ValueError(f"teacher_index selects teacher {j}, whose teacher_weight is None")
        rows = (index == j).nonzero(as_tuple=True)[0]
        th = t_hidden.index_select(0, rows)[:, : w.shape[1]]
        if student_logits is not None:
            sub = (None, None, student_logits.index_select(0, rows))
        else:
            assert student_hidden is not None
            sub = (student_hidden.index_select(0, rows), student_weight, None)
        part, part_total = run(sub, th, w.detach(), rows)
        if part_total is not None:
            total = part_total if total is None else total + part_total
        pieces.append((rows, part))
    for rows, part in pieces:
        out = out.index_put((rows,), part)
    return out, total
