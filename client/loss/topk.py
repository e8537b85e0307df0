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

from . import _checks
from .chunking import Chunking, compute_dtype
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
    if direction == "forward":
        chunking = Chunking.resolve(n, vocab, chunk_tokens, None)
        lse = student_logsumexp(student_hidden, student_weight, student_logits, inv_tau, chunking)
        s = a_ids - lse[:, None]
        if log_prob_min_clamp is not None:
            s = torch.clamp_min(s, log_prob_min_clamp)
            t = torch.clamp_min(t, log_prob_min_clamp)
        return (torch.exp(t) * (t - s)).sum(dim=1)
    log_qs = torch.log_softmax(a_ids, dim=1)
    log_qt = torch.log_softmax(t * inv_tau, dim=1)
    return renormalised_divergence(log_qs, log_qt, direction, float(beta))


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
