"""Per-tile formulas of the full-vocabulary divergences.

This module only states the mathematics; the chunk loops live in
``full_vocab.py``. With ``P = p_S`` and ``Q = p_T`` (softmax over the whole
vocabulary of temperature-scaled logits ``a``, ``b``), each divergence gives

* ``tile_terms(logP, logQ)``: per-row partial sums of the loss and of one
  auxiliary statistic, summed over a vocabulary tile;
* ``tile_grad(logP, logQ, loss, aux)``: ``dL/da`` on a tile, exact once the
  per-row ``loss`` / ``aux`` over the whole vocabulary are known.

The gradients use ``dL/da_u = D_u - P_u Σ_v D_v`` with ``D = dL/dlogP``:

* forward, floor c: ``L = Σ Q (logQ - max(logP, c))``, ``D = -Q·[logP ≥ c]``,
  so ``dL/da = P·S - Q·[logP ≥ c]`` with ``S = Σ_{logP ≥ c} Q`` (S = 1 unfloored);
* reverse: ``L = Σ P (logP - logQ)``, ``dL/da = P (logP - logQ - L)``;
* generalised JSD (0 < β < 1), ``M = (1-β) P + β Q``:
  ``L = β KL(Q‖M) + (1-β) KL(P‖M)``, whose derivative in ``P_v`` collapses to
  ``(1-β)(logP_v - logM_v)``, so ``dL/da = (1-β) P (r - R)`` with
  ``r = logP - logM`` and ``R = Σ P r``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Divergence:
    """Base: a divergence between the student and teacher softmaxes."""

    def online_side(self) -> str | None:
        """'teacher' / 'student' when the loss is an expectation computable in pass 1, else None."""
        return None

    def tile_terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row ``(loss part, aux part)`` of a tile (logP, logQ are normalised)."""
        raise NotImplementedError

    def finish_aux(self, loss: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """The statistic backward needs, from the full-vocabulary sums."""
        return aux

    def tile_grad(
        self, log_p: torch.Tensor, log_q: torch.Tensor, loss: torch.Tensor, aux: torch.Tensor
    ) -> torch.Tensor:
        """``dL/da`` on a tile; may overwrite ``log_p`` and ``log_q``."""
        raise NotImplementedError


@dataclass(frozen=True)
class ForwardKL(Divergence):
    """KL(p_T ‖ p_S), optionally with log p_S floored at ``clamp``."""

    clamp: float | None = None

    def online_side(self) -> str | None:
        # Unfloored: L = E_Q[b - a] - lse_b + lse_a, streamable with the teacher normaliser.
        return "teacher" if self.clamp is None else None

    def tile_terms(self, log_p, log_q):
        q = torch.exp(log_q)
        if self.clamp is None:
            return (q * (log_q - log_p)).sum(dim=1), q.sum(dim=1)
        keep = log_p >= self.clamp
        floored = torch.clamp_min(log_p, self.clamp)
        return (q * (log_q - floored)).sum(dim=1), (q * keep).sum(dim=1)

    def finish_aux(self, loss, aux):
        if self.clamp is None:
            return torch.ones_like(aux)
        return aux

    def tile_grad(self, log_p, log_q, loss, aux):
        if self.clamp is not None:
            # Where the floor binds, log p_S no longer moves the loss.
            log_q = log_q.masked_fill_(log_p < self.clamp, float("-inf"))
        p = torch.exp_(log_p)
        if self.clamp is not None:
            p.mul_(aux[:, None])
        return p.sub_(torch.exp_(log_q))


@dataclass(frozen=True)
class ReverseKL(Divergence):
    """KL(p_S ‖ p_T)."""

    def online_side(self) -> str | None:
        return "student"

    def tile_terms(self, log_p, log_q):
        part = (torch.exp(log_p) * (log_p - log_q)).sum(dim=1)
        return part, part

    def finish_aux(self, loss, aux):
        return loss

    def tile_grad(self, log_p, log_q, loss, aux):
        ratio = log_q.neg_().add_(log_p).sub_(loss[:, None])
        return ratio.mul_(torch.exp_(log_p))


@dataclass(frozen=True)
class GeneralisedJSD(Divergence):
    """β KL(p_T ‖ M) + (1-β) KL(p_S ‖ M) with M = (1-β) p_S + β p_T, for 0 < β < 1."""

    beta: float = 0.5

    def _log_m(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return torch.logaddexp(log_p + math.log1p(-self.beta), log_q + math.log(self.beta))

    def tile_terms(self, log_p, log_q):
        log_m = self._log_m(log_p, log_q)
        student = (torch.exp(log_p) * (log_p - log_m)).sum(dim=1)
        teacher = (torch.exp(log_q) * (log_q - log_m)).sum(dim=1)
        return self.beta * teacher + (1.0 - self.beta) * student, student

    def tile_grad(self, log_p, log_q, loss, aux):
        r = log_p - self._log_m(log_p, log_q)
        r.sub_(aux[:, None]).mul_(torch.exp_(log_p))
        return r.mul_(1.0 - self.beta)


def make_divergence(direction: str, beta: float, clamp: float | None) -> Divergence:
    """Map the public ``direction``/``beta``/``clamp`` onto a divergence.

    β = 0 and β = 1 are the forward and reverse KL (the generalised JSD degenerates
    to zero there, so GKD/TRL special-case them the same way).
    """
    if direction == "forward":
        return ForwardKL(clamp)
    if direction == "reverse":
        return ReverseKL()
    beta = float(beta)
    if beta == 0.0:
        return ForwardKL(None)
    if beta == 1.0:
        return ReverseKL()
    return GeneralisedJSD(beta)
