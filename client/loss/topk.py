"""Top-k divergences over the teacher's top-k ids, as served by the teacher.

* ``forward``: verl's ``forward_kl_topk``: ``Σ_k exp(t_k)(t_k - s_k)`` with ``t``
  the teacher's full-vocabulary log-probs as served and ``s`` the student's
  full-vocabulary log-softmax at those ids (no renormalisation, so the value can
  be negative; verl floors it at 0 in ``distillation_loss``, not here). With a
  clamp ``c`` both log-probs are floored everywhere, the weight included,
  exactly as verl computes it. ``temperature`` scales the student's logits only:
  the teacher's full-vocabulary normaliser at another temperature is unknown
  from k values, so its log-probs are used as served.
* ``reverse`` / ``jsd``: both distributions renormalised over the k ids, then
  KL(q_S‖q_T) or the generalised JSD. The renormalisation cancels each side's
  normaliser, so ``temperature`` is applied exactly to both sides here.

The student's full-vocabulary log-normaliser (forward only) is streamed in
tiles; everything else is ``[N, K]``.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from . import _checks
from .chunking import Chunking, DenseSource, FusedSource, compute_dtype
from .divergences import row_logsumexp
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
from .student_ops import student_logits_at, student_logsumexp


def _check_topk(teacher_topk_ids: torch.Tensor, teacher_topk_logprobs: torch.Tensor) -> None:
    _checks.require_2d("teacher_topk_ids", teacher_topk_ids)
    _checks.require_2d("teacher_topk_logprobs", teacher_topk_logprobs)
    _checks.require_float("teacher_topk_logprobs", teacher_topk_logprobs)
    if teacher_topk_ids.shape != teacher_topk_logprobs.shape:
        raise ValueError(
            f"teacher_topk_ids has shape {tuple(teacher_topk_ids.shape)} but teacher_topk_logprobs has "
            f"{tuple(teacher_topk_logprobs.shape)}"
        )
    if teacher_topk_ids.shape[1] == 0:
        raise ValueError("teacher_topk_ids has k = 0 columns")


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Row-wise KL(a‖b) of normalised log-distributions ``[N, K]``."""
    return (torch.exp(log_a) * (log_a - log_b)).sum(dim=1)


def renormalised_divergence(log_qs: torch.Tensor, log_qt: torch.Tensor, direction: str, beta: float):
    """Divergence between two distributions normalised over the same support ``[N, K]``."""
    if direction == "forward" or (direction == "jsd" and beta == 0.0):
        return _kl(log_qt, log_qs)
    if direction == "reverse" or (direction == "jsd" and beta == 1.0):
        return _kl(log_qs, log_qt)
    log_m = torch.logaddexp(log_qs + math.log1p(-beta), log_qt + math.log(beta))
    return beta * _kl(log_qt, log_m) + (1.0 - beta) * _kl(log_qs, log_m)


def topk_kl(
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    student_hidden: torch.Tensor | None = None,
    student_weight: torch.Tensor | None = None,
    student_logits: torch.Tensor | None = None,
    direction: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    log_prob_min_clamp: float | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token top-k divergence, float32 ``[N]`` (float64 for float64 inputs), differentiable
    in the student inputs."""
    _checks.check_direction(direction, beta)
    _checks.check_temperature(temperature)
    _checks.check_clamp(log_prob_min_clamp, direction)
    _checks.check_chunk("chunk_tokens", chunk_tokens)
    _check_topk(teacher_topk_ids, teacher_topk_logprobs)
    n, vocab = _checks.check_student(
        student_hidden, student_weight, student_logits, teacher_topk_ids.shape[0]
    )
    _checks.check_ids("teacher_topk_ids", teacher_topk_ids, vocab)
    inv_tau = 1.0 / float(temperature)
    t = teacher_topk_logprobs.detach().to(compute_dtype(student_hidden, student_weight, student_logits))
    a_ids = student_logits_at(student_hidden, student_weight, student_logits, teacher_topk_ids, inv_tau)
    lse = None
    if direction == "forward":
        chunking = Chunking.resolve(n, vocab, chunk_tokens, None)
        lse = student_logsumexp(student_hidden, student_weight, student_logits, inv_tau, chunking)
    return topk_terms(a_ids, lse, t, direction, float(beta), inv_tau, log_prob_min_clamp)


def topk_terms(
    a_ids: torch.Tensor,
    lse: torch.Tensor | None,
    t: torch.Tensor,
    direction: str,
    beta: float,
    inv_tau: float,
    clamp: float | None,
) -> torch.Tensor:
    """The per-token top-k divergence from the student's scaled logits at the ids ``[N, K]``, its
    full-vocabulary log-normaliser ``lse [N]`` (forward only) and the teacher's log-probs ``t``.

    The one statement of the formulas: the per-token path differentiates it through
    autograd, the reduced path takes its vector-Jacobian product per token chunk.
    """
    if direction == "forward":
        assert lse is not None
        s = a_ids - lse[:, None]
        if clamp is not None:
            s = torch.clamp_min(s, clamp)
            t = torch.clamp_min(t, clamp)
        return (torch.exp(t) * (t - s)).sum(dim=1)
    log_qs = torch.log_softmax(a_ids, dim=1)
    log_qt = torch.log_softmax(t * inv_tau, dim=1)
    return renormalised_divergence(log_qs, log_qt, direction, beta)


class _ReducedForwardTopK(torch.autograd.Function):
    """``Σ_i w_i transform(ℓ_i)`` of verl's forward top-k KL, gradients formed in the forward pass.

    Per token chunk: whole-vocabulary rows of student logits (1 matmul), their normaliser and
    the logits at the ids read from the same rows, the chunk's vector-Jacobian product through
    ``topk_terms`` (``[rows, K]`` and ``[rows]``, by autograd), then the gradient tile
    ``g_lse · softmax + scatter(g_ids)`` contracted at once (2 matmuls): 3 matmuls over
    ``N·H·V``, the floor, against the per-token path's 4.
    """

    @staticmethod
    def forward(ctx, hidden, weight, logits, ids, t, weights, temperature: float, clamp, chunking: Chunking,
                transform, want: bool):
        inv_tau = 1.0 / temperature
        needs = tuple(bool(x) and want for x in ctx.needs_input_grad[:3])
        dtype = t.dtype
        if logits is None:
            src = FusedSource(hidden, weight, inv_tau, needs[0], needs[1], dtype=dtype)
        else:
            src = DenseSource(logits, inv_tau, grad_logits=needs[2], dtype=dtype)
        n, vocab, dev = src.num_tokens, src.vocab, t.device
        w = weights.to(device=dev, dtype=dtype)
        per_token = torch.empty(n, dtype=dtype, device=dev)
        values = torch.empty_like(per_token)
        for t0, t1 in chunking.token_chunks(n):
            block, wc, ids_c = src.rows(t0, t1), w[t0:t1], ids[t0:t1]
            a = block.tile(0, vocab)
            lse = row_logsumexp(a)
            with torch.enable_grad():
                x = a.gather(1, ids_c).requires_grad_()
                z = lse.detach().requires_grad_()
                loss = topk_terms(x, z, t[t0:t1], "forward", 0.0, inv_tau, clamp)
                value, slope = transformed(loss, transform)
                grad_here = any(needs) and bool(wc.any())
                if grad_here:
                    g_ids, g_lse = torch.autograd.grad(loss, [x, z], row_scale(wc, slope))
            per_token[t0:t1], values[t0:t1] = loss.detach(), value
            if grad_here:
                # d/da of the chunk's total: g_lse · softmax(a) + g_ids at the ids.
                grad = a.sub_(lse[:, None]).exp_().mul_(g_lse[:, None]).scatter_add_(1, ids_c, g_ids)
                block.add_grad(0, vocab, grad)
        if isinstance(src, DenseSource):
            gl = src.grad_logits
            ctx.grads = [None, None, gl.to(logits.dtype) if gl is not None else None]
        else:
            gh, gw = src.grad_hidden, src.grad_weight
            ctx.grads = [gh.to(hidden.dtype) if gh is not None else None,
                         gw.to(weight.dtype) if gw is not None else None, None]
        del src
        ctx.save_for_backward(hidden, weight, logits, ids, t)
        ctx.settings = (temperature, clamp, chunking.chunk_tokens)
        ctx.set_materialize_grads(False)
        return weighted_total(values, w), per_token

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total, grad_per_token):
        grads, per_token_too = hand_over_grads(ctx, grad_total, grad_per_token)
        needs = ctx.needs_input_grad[:3]
        if per_token_too:
            # The per-token output is differentiable too: through the per-token path, recomputed.
            temperature, clamp, chunk_tokens = ctx.settings
            with torch.enable_grad():
                leaves = [None if x is None else x.detach().requires_grad_(nd) for x, nd in zip(ctx.saved_tensors[:3], needs, strict=True)]
                ids, t = ctx.saved_tensors[3:]
                per_token = topk_kl(
                    ids, t, student_hidden=leaves[0], student_weight=leaves[1], student_logits=leaves[2],
                    temperature=temperature, log_prob_min_clamp=clamp, chunk_tokens=chunk_tokens,
                )
                wanted = [x for x in leaves if x is not None and x.requires_grad]
                found = iter(torch.autograd.grad(per_token, wanted, grad_per_token))
            extra = [next(found) if x is not None and x.requires_grad else None for x in leaves]
            grads = add_grads(grads, extra)
        return (*grads, None, None, None, None, None, None, None, None)


def topk_kl_reduced(
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
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
    transform: Transform | None = None,
) -> Reduced:
    """``Σ_i weights_i · transform(ℓ_i)`` of ``topk_kl``'s per-token loss ``ℓ``.

    Forward (verl's ``forward_kl_topk``): the only vocabulary-wide top-k loss (it needs the
    student's full normaliser); its gradients are formed in the forward pass, 3 matmuls over
    ``N·H·V`` against the per-token path's 4, and ``chunk_tokens`` rows of ``[rows, V]`` are
    held at a time. Reverse / JSD touch ``[N, K]`` only, so they are the per-token loss reduced
    under autograd. ``per_token`` is differentiable in every direction (see ``Reduced``).
    """
    _checks.check_direction(direction, beta)
    _checks.check_temperature(temperature)
    _checks.check_clamp(log_prob_min_clamp, direction)
    _checks.check_chunk("chunk_tokens", chunk_tokens)
    _check_topk(teacher_topk_ids, teacher_topk_logprobs)
    n, vocab = _checks.check_student(student_hidden, student_weight, student_logits, teacher_topk_ids.shape[0])
    _checks.check_ids("teacher_topk_ids", teacher_topk_ids, vocab)
    check_weights(weights, n)
    w = weights.detach()
    if direction != "forward":
        per_token = topk_kl(
            teacher_topk_ids, teacher_topk_logprobs, student_hidden=student_hidden, student_weight=student_weight,
            student_logits=student_logits, direction=direction, beta=beta, temperature=temperature,
        )
        values = per_token if transform is None else transform(per_token)
        return Reduced(weighted_total(values, w.to(values.dtype)), per_token)
    t = teacher_topk_logprobs.detach().to(compute_dtype(student_hidden, student_weight, student_logits))
    dev = t.device
    chunking = Chunking.resolve_rows(n, vocab, chunk_tokens, None, dev)
    total, per_token = _ReducedForwardTopK.apply(
        student_hidden, student_weight, student_logits, teacher_topk_ids.to(device=dev, dtype=torch.long), t, w,
        float(temperature), log_prob_min_clamp, chunking, transform, torch.is_grad_enabled(),
    )
    return Reduced(total, per_token)


def topk_masses(
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    student_hidden: torch.Tensor | None = None,
    student_weight: torch.Tensor | None = None,
    student_logits: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token probability mass the student and the teacher put on the teacher's top-k ids.

    A diagnostic (as verl logs it): how much of each distribution the top-k
    losses actually see. Computed without gradient.
    """
    _check_topk(teacher_topk_ids, teacher_topk_logprobs)
    n, vocab = _checks.check_student(
        student_hidden, student_weight, student_logits, teacher_topk_ids.shape[0]
    )
    _checks.check_ids("teacher_topk_ids", teacher_topk_ids, vocab)
    inv_tau = 1.0 / float(temperature)
    with torch.no_grad():
        chunking = Chunking.resolve(n, vocab, chunk_tokens, None)
        lse = student_logsumexp(student_hidden, student_weight, student_logits, inv_tau, chunking)
        a_ids = student_logits_at(student_hidden, student_weight, student_logits, teacher_topk_ids, inv_tau)
        student_mass = torch.exp(a_ids - lse[:, None]).sum(dim=1)
        teacher_mass = torch.exp(teacher_topk_logprobs.float()).sum(dim=1)
    return student_mass, teacher_mass
