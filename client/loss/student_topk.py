"""The reverse KL on the *student's* top-k support, with the teacher scored at those ids.

The teacher-top-k losses (``topk``) see the tokens the teacher likes and miss those the student
puts its mass on, which is exactly what a mode-seeking (reverse) KL must penalise. Here the
support is the student's own top-k (or any ids the trainer chose), sent to the teacher as
``score_ids``; the teacher answers its full-vocabulary log-probs ``t`` at them
(``score_logprobs``). With ``s`` the student's full-vocabulary log-softmax at the same ids:

* ``exact``: the terms of the full reverse KL ``KL(p_S‖p_T)`` on the support,
  ``Σ_k p_S(k)(s_k - t_k)``, ``p_S`` from the student's full softmax (its normaliser streamed in
  tiles, as the forward top-k does). It is the full reverse KL minus the off-support terms, so
  it can be negative when the support leaves out mass; ``temperature`` scales the student's
  logits only (the teacher's normaliser at another temperature is unknown from k values).
* ``renormalised``: both sides renormalised over the support, ``KL(q_S‖q_T)``; the
  normalisers cancel, so ``temperature`` scales both sides exactly.

Padding ids (-1) take no part. The student is given as ``(hidden, lm_head weight)`` (no
``[N, V]`` logits or gradient ever exist: ``student_ops``) or as logits.
"""

from __future__ import annotations

from typing import Unpack

import torch

from . import _checks
from .chunking import Chunking, compute_dtype
from .options import LossOptions, StudentTopKOptions, SupportOptions, read_options
from .student_ops import student_logits_at, student_logsumexp

FORMS = ("exact", "renormalised")


def _check_support(ids: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The valid-id mask [N, K]; raise on mismatched or malformed support inputs."""
    _checks.check_id_table("student_topk_ids", ids, "teacher_score_logprobs", teacher)
    if ids.is_floating_point():
        raise ValueError(f"student_topk_ids must be an integer tensor, got dtype {ids.dtype}")
    return ids >= 0


def _support_inputs(ids: torch.Tensor, teacher: torch.Tensor, o: LossOptions, with_lse: bool):
    """(valid [N, K], student scaled logits at the ids [N, K], lse [N] or None, teacher [N, K])."""
    valid = _check_support(ids, teacher)
    n, vocab = _checks.check_student(*o.student, ids.shape[0])
    _checks.check_ids("student_topk_ids", ids.clamp_min(0), vocab)
    inv_tau = 1.0 / float(o.temperature)
    a = student_logits_at(*o.student, ids.clamp_min(0).to(torch.long), inv_tau)
    lse = None
    if with_lse:
        lse = student_logsumexp(*o.student, inv_tau, Chunking.resolve(n, vocab, o.chunk_tokens, None))
    # Padding's -inf never enters an arithmetic op (its gradient would be NaN, not 0).
    t = torch.where(valid, teacher.detach().to(compute_dtype(*o.student)), 0.0)
    return valid, a, lse, t


def student_topk_reverse_kl(
    student_topk_ids: torch.Tensor, teacher_score_logprobs: torch.Tensor, **options: Unpack[StudentTopKOptions]
) -> torch.Tensor:
    """Per-token reverse KL on the student's top-k support, float32 ``[N]`` (float64 for float64
    inputs), differentiable in the student inputs.

    ``student_topk_ids [N, K]``: the support (-1 pads a row); ``teacher_score_logprobs [N, K]``:
    the teacher's full-vocabulary log-probs at those ids as served (``TeacherScores.score_logprobs``).
    """
    o = read_options(StudentTopKOptions, options, "student_topk_reverse_kl")
    if o.form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {o.form!r}")
    _checks.check_temperature(o.temperature)
    _checks.check_chunk("chunk_tokens", o.chunk_tokens)
    valid, a, lse, t = _support_inputs(student_topk_ids, teacher_score_logprobs, o, with_lse=o.form == "exact")
    if o.form == "exact":
        s = torch.where(valid, a - lse[:, None], 0.0)
        p = torch.where(valid, torch.exp(s), 0.0)
        return (p * (s - t)).sum(dim=1)
    # Rows without a valid id score 0. Padding's -inf is replaced before any product, since the
    # gradient of 0 · (-inf) is NaN even where `where` discards the value.
    empty = ~valid.any(dim=1, keepdim=True)
    inv_tau = 1.0 / float(o.temperature)

    def support_log_softmax(x: torch.Tensor) -> torch.Tensor:
        log_q = torch.log_softmax(torch.where(valid, x, float("-inf")).masked_fill(empty, 0.0), dim=1)
        return torch.where(valid, log_q, 0.0)

    log_qs, log_qt = support_log_softmax(a), support_log_softmax(t * inv_tau)
    return torch.where(valid, torch.exp(log_qs) * (log_qs - log_qt), 0.0).sum(dim=1)


def student_topk_masses(
    student_topk_ids: torch.Tensor, teacher_score_logprobs: torch.Tensor, **options: Unpack[SupportOptions]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token mass the student and the teacher put on the student's support (no gradient):
    how much of each distribution the loss sees. A low teacher mass on a high student mass is
    the student's mass where the teacher puts none, what the reverse KL removes."""
    with torch.no_grad():
        o = read_options(SupportOptions, options, "student_topk_masses")
        valid, a, lse, t = _support_inputs(student_topk_ids, teacher_score_logprobs, o, with_lse=True)
        student = torch.where(valid, torch.exp(a - lse[:, None]), 0.0).sum(dim=1)
        teacher = torch.where(valid, torch.exp(t), 0.0).sum(dim=1)
    return student, teacher


__all__ = ["FORMS", "student_topk_masses", "student_topk_reverse_kl"]
