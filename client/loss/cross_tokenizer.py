"""Distillation across tokenizers: the student's tokens against a teacher of another vocabulary.

The teacher's scores come aligned to the student's rows (`TeacherClient.score(...,
student_tokenizer=...)`, packed by `proctor.client.pack_aligned`): the response is cut into
chunks that are whole tokens on both sides.

* ``chunk_likelihood_loss`` (ALM-style, arXiv 2503.20083): per chunk, the student's chunk
  log-likelihood ``ℓ_S`` (the sum of its token log-probs over the chunk) against the teacher's
  ``ℓ_T``, compared as the binary KL of the chunk's probability:
  ``p_T (ℓ_T - ℓ_S) + (1 - p_T)(log(1 - p_T) - log(1 - p_S))`` with ``p = exp(ℓ)``, ``≥ 0`` and
  ``0`` exactly when the likelihoods agree. Both are held below ``-CHUNK_LOGPROB_CEILING`` (the
  binary term is undefined at p = 1). Returns ``[C]``, one value per chunk, in order.
* ``gold_hybrid_loss`` (GOLD-style): at exactly mapped rows (a chunk of one student and one
  teacher token) the forward KL on the teacher's top-k in student ids,
  ``Σ_k exp(t_k)(t_k - s_k)`` over the ids that have an exact match; at the first row of every
  other chunk (both sides predict the text after the same prefix, in their own vocabularies)
  ULD: ``Σ_i |sort↓(p_S)_i - sort↓(p_T)_i|`` over the K largest probabilities of each side;
  ``0`` at the remaining rows (see ``AlignedBatch.exact`` / ``uld`` for the mask). Returns ``[N]``.

The student is given as logits ``[N, V]`` (its whole softmax is needed for ULD's sorting);
``temperature`` divides them.
"""

from __future__ import annotations

import math

import torch

from . import _checks

CHUNK_LOGPROB_CEILING = 1e-6


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Mächler's split at -log 2)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _chunks(chunk_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    if chunk_ids.dim() != 1 or chunk_ids.shape[0] != rows:
        raise ValueError(f"chunk_ids must be 1-D with {rows} rows, got shape {tuple(chunk_ids.shape)}")
    _, inverse = torch.unique_consecutive(chunk_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if rows else 0


def chunk_likelihood_loss(student_logprobs: torch.Tensor, chunk_ids: torch.Tensor,
                          teacher_chunk_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-chunk binary KL of the teacher's vs the student's chunk likelihood, ``[C]``.

    ``student_logprobs`` ``[N]``: the student's log-prob of each of its tokens (differentiable);
    ``chunk_ids`` ``[N]``: each row's chunk, a new chunk wherever the id changes;
    ``teacher_chunk_logprobs`` ``[N]``: each row's chunk's teacher log-likelihood.
    """
    if student_logprobs.dim() != 1 or teacher_chunk_logprobs.shape != student_logprobs.shape:
        raise ValueError(f"student_logprobs and teacher_chunk_logprobs must be [N] alike, got "
                         f"{tuple(student_logprobs.shape)} and {tuple(teacher_chunk_logprobs.shape)}")
    _checks.require_float("student_logprobs", student_logprobs)
    inverse, count = _chunks(chunk_ids, student_logprobs.shape[0])
    dtype = torch.promote_types(student_logprobs.dtype, torch.float32)
    student = torch.zeros(count, dtype=dtype, device=student_logprobs.device).index_add(
        0, inverse, student_logprobs.to(dtype))
    teacher = torch.zeros(count, dtype=dtype, device=student_logprobs.device).scatter(
        0, inverse, teacher_chunk_logprobs.to(dtype))
    student = student.clamp(max=-CHUNK_LOGPROB_CEILING)
    teacher = teacher.clamp(max=-CHUNK_LOGPROB_CEILING)
    p_teacher = teacher.exp()
    return p_teacher * (teacher - student) + (1 - p_teacher) * (_log1mexp(teacher) - _log1mexp(student))


def gold_hybrid_loss(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                     exact: torch.Tensor, uld: torch.Tensor, uld_teacher_logprobs: torch.Tensor, *,
                     temperature: float = 1.0) -> torch.Tensor:
    """Per-row GOLD-style loss ``[N]``: top-k forward KL at ``exact`` rows, ULD at ``uld`` rows.

    ``topk_ids`` / ``topk_logprobs`` ``[N, K]``: the teacher's top-k in student ids (-1: no
    match, ignored); ``uld_teacher_logprobs`` ``[N, K']``: the teacher's top-k log-probs (most
    likely first) at the ``uld`` rows; ``exact`` / ``uld``: bool ``[N]``, never both.
    """
    n, vocab = _checks.check_student(None, None, student_logits, None)
    _checks.check_id_table("topk_ids", topk_ids, "topk_logprobs", topk_logprobs)
    _checks.check_temperature(temperature)
    for name, mask in (("exact", exact), ("uld", uld)):
        if mask.dtype != torch.bool or mask.shape != (n,):
            raise ValueError(f"{name} must be a bool [N] mask with N = {n}, got {mask.dtype} {tuple(mask.shape)}")
    if bool((exact & uld).any()):
        raise ValueError("a row is both exact and uld")
    k_uld = uld_teacher_logprobs.shape[1]
    if uld_teacher_logprobs.shape[0] != n or k_uld > vocab:
        raise ValueError(f"uld_teacher_logprobs must be [N, K'] with K' <= V = {vocab}, got "
                         f"{tuple(uld_teacher_logprobs.shape)}")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_p = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    mapped = topk_ids >= 0
    teacher = torch.where(mapped, topk_logprobs.to(dtype), 0.0)
    weight = torch.where(mapped, teacher.exp(), 0.0)
    student = log_p.gather(1, torch.where(mapped, topk_ids, 0).long())
    exact_term = (weight * (teacher - student)).sum(dim=1)
    student_sorted = torch.topk(log_p, k_uld, dim=1).values.exp()
    teacher_sorted = uld_teacher_logprobs.to(dtype).exp()  # -inf (no value) is probability 0
    uld_term = (student_sorted - teacher_sorted).abs().sum(dim=1)
    zero = torch.zeros((), dtype=dtype, device=log_p.device)
    return torch.where(exact, exact_term, torch.where(uld, uld_term, zero))
