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

import contextlib
import math
import os
from collections.abc import Iterator
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

    def row_terms_and_grad(
        self, log_p: torch.Tensor, log_q: torch.Tensor, want_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(loss, aux, dL/da)`` of rows that span the whole vocabulary: the tile formulas in
        order. A divergence whose loss and gradient share work overrides it to do that work once."""
        loss, aux = self.tile_terms(log_p, log_q)
        aux = self.finish_aux(loss, aux)
        grad = self.tile_grad(log_p, log_q, loss, aux) if want_grad else None
        return loss, aux, grad


@dataclass(frozen=True)
class ForwardKL(Divergence):
    """KL(p_T ‖ p_S), optionally with log p_S floored at ``clamp``."""

    clamp: float | None = None

    def online_side(self) -> str | None:
        # Unfloored: L = E_Q[b - a] - lse_b + lse_a, streamable with the teacher normaliser.
        return "teacher" if self.clamp is None else None

    def tile_terms(self, log_p, log_q):
        # In-place on fresh temporaries: whole-vocabulary rows are large, so each buffer counts.
        q = torch.exp(log_q)
        if self.clamp is None:
            return (log_q - log_p).mul_(q).sum(dim=1), q.sum(dim=1)
        loss = (log_q - torch.clamp_min(log_p, self.clamp)).mul_(q).sum(dim=1)
        return loss, q.masked_fill_(log_p < self.clamp, 0.0).sum(dim=1)

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
        part = (log_p - log_q).mul_(torch.exp(log_p)).sum(dim=1)
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
        shifted = log_p + math.log1p(-self.beta)
        return torch.logaddexp(shifted, log_q + math.log(self.beta), out=shifted)

    def tile_terms(self, log_p, log_q):
        log_m = self._log_m(log_p, log_q)
        student = (log_p - log_m).mul_(torch.exp(log_p)).sum(dim=1)
        teacher = log_m.neg_().add_(log_q).mul_(torch.exp(log_q)).sum(dim=1)
        return self.beta * teacher + (1.0 - self.beta) * student, student

    def tile_grad(self, log_p, log_q, loss, aux):
        r = log_p - self._log_m(log_p, log_q)
        r.sub_(aux[:, None]).mul_(torch.exp_(log_p))
        return r.mul_(1.0 - self.beta)

    def row_terms_and_grad(self, log_p, log_q, want_grad):
        """The same formulas as `tile_terms` then `tile_grad`, with the mixture log M and the
        student's probabilities computed once for both (the loss and its gradient share them)."""
        if not want_grad:
            return super().row_terms_and_grad(log_p, log_q, want_grad)
        log_m = self._log_m(log_p, log_q)
        r = log_p - log_m  # log P - log M
        p = torch.exp(log_p)
        student = (r * p).sum(dim=1)
        teacher = log_m.neg_().add_(log_q).mul_(torch.exp_(log_q)).sum(dim=1)
        loss = self.beta * teacher + (1.0 - self.beta) * student
        aux = self.finish_aux(loss, student)
        grad = r.sub_(aux[:, None]).mul_(p).mul_(1.0 - self.beta)
        return loss, aux, grad


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


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Per-row log-sum-exp of finite logits: one temporary, a third of ``torch.logsumexp``'s time on CPU
    (measured at 128 x 32768), which also guards infinities that fused logits cannot hold."""
    m = x.amax(dim=1)
    return m + torch.log(torch.exp_(x - m[:, None]).sum(dim=1))


def full_rows(
    div: Divergence, a: torch.Tensor, b: torch.Tensor, want_grad: bool, inplace: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss, lse_a, lse_b, aux, dL/da)`` of rows whose tiles span the whole vocabulary.

    The tile function of the reduced losses: with the whole row at hand the normalisers come
    first, then ``row_terms_and_grad`` (the same ``tile_terms`` / ``finish_aux`` / ``tile_grad``
    the chunked passes use, fused where a divergence can share their work). ``inplace`` lets the eager path reuse ``a`` and ``b``
    (they become log p_S / log q_T, then the gradient); the compiled path passes False, because
    mutating a compiled function's inputs costs an extra copy.
    """
    ls, lt = row_logsumexp(a), row_logsumexp(b)
    log_p = a.sub_(ls[:, None]) if inplace else a - ls[:, None]
    log_q = b.sub_(lt[:, None]) if inplace else b - lt[:, None]
    loss, aux, grad = div.row_terms_and_grad(log_p, log_q, want_grad)
    return loss, ls, lt, aux, grad


# Eager tile math walks its rows in slices of this many elements (2 MiB float32): the handful of
# temporaries a slice needs then stays in the last-level cache, where a [128, 32768] row block's
# would stream through memory once per elementwise op (measured 3-5x slower on this CPU).
CACHE_SLICE_ELEMENTS = 1 << 19


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform: assume an idle machine
        return 0.0


@contextlib.contextmanager
def one_intraop_thread(device: torch.device) -> Iterator[None]:
    """Run the enclosed CPU ops on one intra-op thread, then restore the thread count.

    The sliced tile math is some twenty short memory-bound ops per 2 MiB slice, and each op of a
    two-thread team ends at a barrier: on a CPU shared with other work, every op then waits for
    whichever thread was descheduled. Measured on 2 shared cores (load about 3) on a [256, 32768]
    block, forward KL: median 0.63 ms/row with two threads, worst 7.5, against 0.21 and 0.25 with
    one; the whole reduced loss (N=1024, reverse KL, runs interleaved) took 8.3 s median against
    5.4 s. On an idle machine two threads are faster (the whole reduced loss 3-7% at N=2048), so
    the switch happens only when the CPU is oversubscribed: a 1-minute load average above what
    this computation's own threads make (the thread count, plus one runnable beyond it). The
    matmuls keep every thread either way.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads <= 1 or _load_average() < threads + 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def full_rows_sliced(
    div: Divergence, a: torch.Tensor, b: torch.Tensor, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``full_rows`` in place, a cache-sized slice of rows at a time, on one intra-op thread (see
    ``one_intraop_thread``); the gradient ends up in ``a``."""
    rows = a.shape[0]
    step = max(1, CACHE_SLICE_ELEMENTS // max(1, a.shape[1]))
    with one_intraop_thread(a.device):
        if step >= rows:
            return full_rows(div, a, b, want_grad)
        stats = [torch.empty(rows, dtype=a.dtype, device=a.device) for _ in range(4)]
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            a_part = a[r0:r1]
            *parts, grad = full_rows(div, a_part, b[r0:r1], want_grad)
            for full, part in zip(stats, parts, strict=True):
                full[r0:r1] = part
            if grad is not None and grad.data_ptr() != a_part.data_ptr():
                a_part.copy_(grad)
    return stats[0], stats[1], stats[2], stats[3], (a if want_grad else None)
