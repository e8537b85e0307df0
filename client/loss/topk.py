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
tiles; everything else is ``[N, K]``. ``topk_terms`` states the formulas once: the
per-token path differentiates it through autograd; the reduced forward KL is a
``ChunkedLoss`` on whole-vocabulary rows that ``chunked_loss`` runs.
"""

from __future__ import annotations

import math
from typing import Unpack

import torch

from . import _checks
from .chunked_loss import ChunkedLoss, GradFn, RowBuffers, Stats, reduced
from .chunking import Chunking, RowBlock, compute_dtype
from .divergences import row_logsumexp
from .options import DivergenceOptions, SupportOptions, read_options
from .reduced import Reduced, Transform, check_weights, weighted_total
from .student_ops import student_logits_at, student_logsumexp


def _check_inputs(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    logits: torch.Tensor | None,
) -> tuple[int, int]:
    """Validate the teacher's top-k table and the student; return ``(N, V)``."""
    _checks.check_id_table("teacher_topk_ids", ids, "teacher_topk_logprobs", logprobs)
    n, vocab = _checks.check_student(hidden, weight, logits, ids.shape[0])
    _checks.check_ids("teacher_topk_ids", ids, vocab)
    return n, vocab


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
    teacher_topk_ids: torch.Tensor, teacher_topk_logprobs: torch.Tensor, **options: Unpack[DivergenceOptions]
) -> torch.Tensor:
    """Per-token top-k divergence, float32 ``[N]`` (float64 for float64 inputs), differentiable
    in the student inputs (``options``: ``DivergenceOptions``)."""
    o = read_options(DivergenceOptions, options, "topk_kl")
    _checks.check_options(o.direction, o.beta, o.temperature, o.log_prob_min_clamp, o.chunk_tokens)
    n, vocab = _check_inputs(teacher_topk_ids, teacher_topk_logprobs, *o.student)
    inv_tau = 1.0 / float(o.temperature)
    t = teacher_topk_logprobs.detach().to(compute_dtype(*o.student))
    a_ids = student_logits_at(*o.student, teacher_topk_ids, inv_tau)
    lse = None
    if o.direction == "forward":
        lse = student_logsumexp(*o.student, inv_tau, Chunking.resolve(n, vocab, o.chunk_tokens, None))
    return topk_terms(a_ids, lse, t, o.direction, float(o.beta), inv_tau, o.log_prob_min_clamp)


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


class _ForwardTopKLoss(ChunkedLoss):
    """verl's forward top-k KL as a ``ChunkedLoss`` on whole-vocabulary rows, for the reduced path.

    Per token chunk: rows of student logits (1 matmul), their normaliser and the logits at the
    ids read from the same rows, the chunk's vector-Jacobian product through ``topk_terms``
    (``[rows, K]`` and ``[rows]``, by autograd), then the gradient tile
    ``g_lse · softmax + scatter(g_ids)`` contracted at once (2 matmuls): 3 matmuls over
    ``N·H·V``, the floor, against the per-token path's 4.
    """

    def __init__(self, ids: torch.Tensor, t: torch.Tensor, clamp: float | None, inv_tau: float,
                 chunking: Chunking) -> None:
        super().__init__(inv_tau, chunking, t.dtype)
        self.ids, self.t, self.clamp = ids, t, clamp

    def _terms(self, block: RowBlock, a: torch.Tensor, want_grad: bool) -> tuple[torch.Tensor, GradFn | None]:
        """The chunk's loss from its whole rows ``a``, and (``want_grad``) the function adding
        ``Σ_rows scale · dℓ/da`` to ``block``; ``a`` becomes the gradient tile."""
        ids = self.ids[block.t0 : block.t1]
        lse = row_logsumexp(a)
        with torch.enable_grad():
            x = a.gather(1, ids).requires_grad_()
            z = lse.detach().requires_grad_()
            loss = topk_terms(x, z, self.t[block.t0 : block.t1], "forward", 0.0, self.inv_tau, self.clamp)

        def add_grad(scale: torch.Tensor) -> None:
            g_ids, g_lse = torch.autograd.grad(loss, [x, z], scale)
            # d/da of the chunk's total: g_lse · softmax(a) + g_ids at the ids.
            block.add_grad(0, block.vocab, a.sub_(lse[:, None]).exp_().mul_(g_lse[:, None]).scatter_add_(1, ids, g_ids))

        return loss.detach(), (add_grad if want_grad else None)

    def chunk_stats(self, block: RowBlock) -> Stats:
        return (self._terms(block, block.tile(0, block.vocab), False)[0],)

    def chunk_grad(self, block: RowBlock, stats: Stats, scale: torch.Tensor) -> None:
        _, add_grad = self._terms(block, block.tile(0, block.vocab), True)
        assert add_grad is not None
        add_grad(scale)

    def chunk_stats_and_grad(
        self, block: RowBlock, buffers: RowBuffers, want_grad: bool
    ) -> tuple[Stats, GradFn | None]:
        """The gradient tile is formed in place in the rows the loss was read from."""
        loss, add_grad = self._terms(block, block.tile(0, block.vocab, out=buffers.get(0, block.num_rows)), want_grad)
        return (loss,), add_grad


def topk_kl_reduced(
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    weights: torch.Tensor,
    *,
    transform: Transform | None = None,
    **options: Unpack[DivergenceOptions],
) -> Reduced:
    """``Σ_i weights_i · transform(ℓ_i)`` of ``topk_kl``'s per-token loss ``ℓ``.

    Forward (verl's ``forward_kl_topk``): the only vocabulary-wide top-k loss (it needs the
    student's full normaliser); its gradients are formed in the forward pass, 3 matmuls over
    ``N·H·V`` against the per-token path's 4, and ``chunk_tokens`` rows of ``[rows, V]`` are
    held at a time. Reverse / JSD touch ``[N, K]`` only, so they are the per-token loss reduced
    under autograd. ``per_token`` is differentiable in every direction (see ``Reduced``).
    """
    o = read_options(DivergenceOptions, options, "topk_kl_reduced")
    _checks.check_options(o.direction, o.beta, o.temperature, o.log_prob_min_clamp, o.chunk_tokens)
    n, vocab = _check_inputs(teacher_topk_ids, teacher_topk_logprobs, *o.student)
    check_weights(weights, n)
    if o.direction != "forward":
        per_token = topk_kl(teacher_topk_ids, teacher_topk_logprobs, **options)
        values = per_token if transform is None else transform(per_token)
        return Reduced(weighted_total(values, weights.detach().to(values.dtype)), per_token)
    t = teacher_topk_logprobs.detach().to(compute_dtype(*o.student))
    chunking = Chunking.resolve_rows(n, vocab, o.chunk_tokens, None, t.device)
    ids = teacher_topk_ids.to(device=t.device, dtype=torch.long)
    loss = _ForwardTopKLoss(ids, t, o.log_prob_min_clamp, 1.0 / float(o.temperature), chunking)
    return reduced(loss, *o.student, weights, transform)


def topk_masses(
    teacher_topk_ids: torch.Tensor, teacher_topk_logprobs: torch.Tensor, **options: Unpack[SupportOptions]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token probability mass the student and the teacher put on the teacher's top-k ids.

    A diagnostic (as verl logs it): how much of each distribution the top-k
    losses actually see. Computed without gradient.
    """
    o = read_options(SupportOptions, options, "topk_masses")
    n, vocab = _check_inputs(teacher_topk_ids, teacher_topk_logprobs, *o.student)
    inv_tau = 1.0 / float(o.temperature)
    with torch.no_grad():
        lse = student_logsumexp(*o.student, inv_tau, Chunking.resolve(n, vocab, o.chunk_tokens, None))
        a_ids = student_logits_at(*o.student, teacher_topk_ids, inv_tau)
        student_mass = torch.exp(a_ids - lse[:, None]).sum(dim=1)
        teacher_mass = torch.exp(teacher_topk_logprobs.float()).sum(dim=1)
    return student_mass, teacher_mass
