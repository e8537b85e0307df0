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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import _checks
from .chunking import Chunking, DenseSource, FusedSource, OnlineLogSumExp, compute_dtype
from .divergences import Divergence, make_divergence


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
        hidden, weight, spec.inv_tau, grad_hidden=needs_grad[0], grad_weight=needs_grad[1], dtype=spec.dtype
    )


def _forward_stats(
    student: FusedSource | DenseSource, teacher: FusedSource, spec: _Spec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(loss, lse_student, lse_teacher, aux)`` without any ``[N, V]`` tensor."""
    n, vocab = student.num_tokens, student.vocab
    dev = teacher.hidden.device
    div, ch = spec.divergence, spec.chunking
    loss = torch.empty(n, dtype=spec.dtype, device=dev)
    lse_s = torch.empty_like(loss)
    lse_t = torch.empty_like(loss)
    aux = torch.empty_like(loss)
    online = div.online_side()
    single = ch.single_vocab_chunk(vocab)
    for t0, t1 in ch.token_chunks(n):
        rows = t1 - t0
        sb, tb = student.rows(t0, t1), teacher.rows(t0, t1)
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
        lse_s[t0:t1], lse_t[t0:t1] = ls, lt
        if online is not None:
            if online == "teacher":
                chunk_loss = acc_t.expectation() - lt + ls
            else:
                chunk_loss = acc_s.expectation() - ls + lt
            chunk_aux = torch.zeros_like(chunk_loss)
        else:
            chunk_loss = torch.zeros(rows, dtype=spec.dtype, device=dev)
            chunk_aux = torch.zeros_like(chunk_loss)
            for v0, v1 in ch.vocab_chunks(vocab):
                a, b = kept if kept is not None else (sb.tile(v0, v1), tb.tile(v0, v1))
                part_loss, part_aux = div.tile_terms(a.sub_(ls[:, None]), b.sub_(lt[:, None]))
                chunk_loss += part_loss
                chunk_aux += part_aux
        loss[t0:t1] = chunk_loss
        aux[t0:t1] = div.finish_aux(chunk_loss, chunk_aux)
    return loss, lse_s, lse_t, aux


def _backward_grads(
    student: FusedSource | DenseSource,
    teacher: FusedSource,
    spec: _Spec,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    grad_out: torch.Tensor,
) -> None:
    """Accumulate ``Σ_n grad_out_n · dL_n/d(student)`` into the student source's buffers."""
    loss, lse_s, lse_t, aux = stats
    ch = spec.chunking
    for t0, t1 in ch.token_chunks(student.num_tokens):
        g = grad_out[t0:t1]
        if not bool(g.any()):
            continue
        sb, tb = student.rows(t0, t1), teacher.rows(t0, t1)
        ls, lt = lse_s[t0:t1, None], lse_t[t0:t1, None]
        for v0, v1 in ch.vocab_chunks(student.vocab):
            log_p = sb.tile(v0, v1).sub_(ls)
            log_q = tb.tile(v0, v1).sub_(lt)
            grad_tile = spec.divergence.tile_grad(log_p, log_q, loss[t0:t1], aux[t0:t1])
            sb.add_grad(v0, v1, grad_tile.mul_(g[:, None]))


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
        if isinstance(student, DenseSource):
            gl = student.grad_logits
            return None, None, (gl.to(s_logits.dtype) if gl is not None else None), None, None, None
        gh, gw = student.grad_hidden, student.grad_weight
        return (
            gh.to(s_hidden.dtype) if gh is not None else None,
            gw.to(s_weight.dtype) if gw is not None else None,
            None,
            None,
            None,
            None,
        )


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
    ``teacher_weight``.
    """
    _checks.check_direction(direction, beta)
    _checks.check_temperature(temperature)
    _checks.check_clamp(log_prob_min_clamp, direction)
    _checks.check_chunk("chunk_tokens", chunk_tokens)
    _checks.check_chunk("chunk_vocab", chunk_vocab)
    _checks.require_2d("teacher_hidden", teacher_hidden)
    n, vocab = _checks.check_student(student_hidden, student_weight, student_logits, teacher_hidden.shape[0])
    weights = _check_teacher(teacher_hidden, teacher_weight, teacher_index, vocab)
    spec = _Spec(
        make_divergence(direction, beta, log_prob_min_clamp),
        1.0 / float(temperature),
        Chunking.resolve(n, vocab, chunk_tokens, chunk_vocab),
        compute_dtype(student_hidden, student_weight, student_logits, teacher_hidden),
    )
    t_hidden = teacher_hidden.detach()
    if teacher_index is None:
        if weights[0] is None:
            raise ValueError("teacher_weight is None: the teacher has no unembedding")
        return _FullVocabFunction.apply(
            student_hidden, student_weight, student_logits, t_hidden, weights[0].detach(), spec
        )
    return _multi_teacher(
        t_hidden, weights, teacher_index, student_hidden, student_weight, student_logits, spec
    )


def _multi_teacher(
    t_hidden: torch.Tensor,
    weights: list,
    teacher_index: torch.Tensor,
    student_hidden: torch.Tensor | None,
    student_weight: torch.Tensor | None,
    student_logits: torch.Tensor | None,
    spec: _Spec,
) -> torch.Tensor:
    """Group tokens by teacher, run one chunked pass per group, scatter the losses back."""
    n = t_hidden.shape[0]
    if not isinstance(teacher_index, torch.Tensor) or teacher_index.shape != (n,):
        shape = tuple(teacher_index.shape) if isinstance(teacher_index, torch.Tensor) else None
        raise ValueError(f"teacher_index must be a tensor of shape ({n},), got {shape}")
    _checks.check_ids("teacher_index", teacher_index, len(weights))
    index = teacher_index.to(device=t_hidden.device, dtype=torch.long)
    out = torch.zeros(n, dtype=spec.dtype, device=t_hidden.device)
    pieces = []
    for j in torch.unique(index).tolist():
        w = weights[j]
        if w is None:
            raise ValueError(f"teacher_index selects teacher {j}, whose teacher_weight is None")
        rows = (index == j).nonzero(as_tuple=True)[0]
        th = t_hidden.index_select(0, rows)[:, : w.shape[1]]
        if student_logits is not None:
            part = _FullVocabFunction.apply(
                None, None, student_logits.index_select(0, rows), th, w.detach(), spec
            )
        else:
            assert student_hidden is not None
            part = _FullVocabFunction.apply(
                student_hidden.index_select(0, rows), student_weight, None, th, w.detach(), spec
            )
        pieces.append((rows, part))
    for rows, part in pieces:
        out = out.index_put((rows,), part)
    return out
