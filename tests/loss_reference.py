"""Float64 dense references for the loss tests: the definitions, written the obvious way.

Each reference materialises full ``[N, V]`` float64 log-probs and lets autograd
differentiate, so it shares no code or algebra with the chunked kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ``‖x - ref‖ / ‖ref‖`` in float64."""
    x, ref = x.detach().to(F64), ref.detach().to(F64)
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _jsd(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalised JSD as GKD/TRL define it (student log_p, teacher log_q)."""
    if beta == 0.0:
        return _kl(log_q, log_p)
    if beta == 1.0:
        return _kl(log_p, log_q)
    log_m = torch.logaddexp(log_p + math.log(1 - beta), log_q + math.log(beta))
    return beta * _kl(log_q, log_m) + (1 - beta) * _kl(log_p, log_m)


def full_vocab_ref(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    direction: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token divergence over the whole vocabulary, float64."""
    log_p = torch.log_softmax(student_logits.to(F64) / temperature, -1)
    log_q = torch.log_softmax(teacher_logits.to(F64) / temperature, -1)
    if direction == "forward":
        floored = log_p if clamp is None else torch.clamp_min(log_p, clamp)
        return (log_q.exp() * (log_q - floored)).sum(-1)
    if direction == "reverse":
        return _kl(log_p, log_q)
    return _jsd(log_p, log_q, beta)


def topk_ref(
    student_logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    direction: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token top-k divergence, float64, as the issue / verl define it."""
    log_p_full = torch.log_softmax(student_logits.to(F64) / temperature, -1)
    s = log_p_full.gather(1, ids.long())
    t = teacher_logprobs.to(F64)
    if direction == "forward":
        if clamp is not None:
            s, t = torch.clamp_min(s, clamp), torch.clamp_min(t, clamp)
        return (t.exp() * (t - s)).sum(-1)
    log_qs = torch.log_softmax(student_logits.to(F64).gather(1, ids.long()) / temperature, -1)
    log_qt = torch.log_softmax(t / temperature, -1)
    if direction == "reverse":
        return _kl(log_qs, log_qt)
    return _jsd(log_qs, log_qt, beta)


def sampled_ref(s: torch.Tensor, t: torch.Tensor, mode: str) -> torch.Tensor:
    """verl's ``kl_penalty_forward``, float64."""
    s, t = s.to(F64), t.to(F64)
    if mode in ("kl", "k1"):
        return s - t
    if mode == "abs":
        return (s - t).abs()
    if mode in ("mse", "k2"):
        return 0.5 * (s - t) ** 2
    r = (t - s).clamp(-20, 20)
    return (r.exp() - r - 1).clamp(-10, 10)


@dataclass
class Case:
    """Random student/teacher inputs; logits are fused ``hidden @ weight.T`` products."""

    student_hidden: torch.Tensor
    student_weight: torch.Tensor
    teacher_hidden: torch.Tensor
    teacher_weight: torch.Tensor

    @property
    def student_logits(self) -> torch.Tensor:
        return self.student_hidden @ self.student_weight.T

    @property
    def teacher_logits(self) -> torch.Tensor:
        return self.teacher_hidden @ self.teacher_weight.T

    @property
    def student_logits64(self) -> torch.Tensor:
        """Exact float64 product of the (possibly bf16-rounded) inputs."""
        return self.student_hidden.to(F64) @ self.student_weight.to(F64).T

    @property
    def teacher_logits64(self) -> torch.Tensor:
        return self.teacher_hidden.to(F64) @ self.teacher_weight.to(F64).T


def make_case(
    n: int = 29,
    h: int = 16,
    v: int = 97,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    h_teacher: int | None = None,
) -> Case:
    """Random inputs whose logits have a spread like a real LM head's (std ≈ 2·scale)."""
    g = torch.Generator().manual_seed(seed)
    ht = h if h_teacher is None else h_teacher

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=F64) * std).to(dtype)

    s = 2.0 * scale / math.sqrt(h)
    return Case(
        rnd(n, h, std=1.0),
        rnd(v, h, std=s),
        rnd(n, ht, std=1.0),
        rnd(v, ht, std=2.0 * scale / math.sqrt(ht)),
    )


def topk_of(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids and full-vocabulary log-probs at them (what a server returns)."""
    log_q = torch.log_softmax(teacher_logits.to(F64), -1)
    vals, ids = log_q.topk(k, dim=-1)
    return ids, vals


def student_topk_ref(
    student_logits: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor, form: str, temperature: float = 1.0
) -> torch.Tensor:
    """Reverse KL on each row's support ``ids`` (-1 pads), row by row in float64.

    ``exact``: ``Σ_k p_S(k) (log p_S(k) - t_k)`` with the student's full softmax at ``T``;
    ``renormalised``: ``KL(q_S‖q_T)``, both renormalised over the support, both at ``T``.
    """
    log_p = torch.log_softmax(student_logits.to(F64) / temperature, dim=-1)
    rows = []
    for r in range(ids.shape[0]):
        keep = ids[r] >= 0
        support, t = ids[r][keep].long(), teacher[r][keep].to(F64)
        if support.numel() == 0:
            rows.append(log_p.new_zeros(()) * log_p[r].sum())
            continue
        s = log_p[r][support]
        if form == "exact":
            rows.append((s.exp() * (s - t)).sum())
        else:
            rows.append(_kl(torch.log_softmax(s, -1), torch.log_softmax(t / temperature, -1)))
    return torch.stack(rows)


def chunk_likelihood_ref(student_logprobs: torch.Tensor, chunk_ids: list[int],
                         teacher_chunk_logprobs: list[float], ceiling: float) -> torch.Tensor:
    """ALM's binary KL per chunk, float64, one chunk at a time (a new chunk where the id changes)."""
    losses = []
    start = 0
    for stop in range(1, len(chunk_ids) + 1):
        if stop < len(chunk_ids) and chunk_ids[stop] == chunk_ids[start]:
            continue
        student = torch.clamp(student_logprobs[start:stop].to(F64).sum(), max=-ceiling)
        teacher = min(float(teacher_chunk_logprobs[start]), -ceiling)
        p_t = math.exp(teacher)
        p_s = torch.exp(student)
        losses.append(p_t * (math.log(p_t) - torch.log(p_s)) + (1 - p_t) * (math.log(1 - p_t) - torch.log(1 - p_s)))
        start = stop
    return torch.stack(losses)


def gold_hybrid_ref(student_logits: torch.Tensor, topk_ids: list[list[int]], topk_logprobs: list[list[float]],
                    exact: list[bool], uld: list[bool], uld_teacher_logprobs: list[list[float]],
                    temperature: float = 1.0) -> torch.Tensor:
    """Per row, float64: the forward KL over the mapped teacher ids, or the L1 distance of the two
    sides' K largest probabilities, each sorted (ULD); 0 elsewhere."""
    rows = []
    for r in range(student_logits.shape[0]):
        log_p = torch.log_softmax(student_logits[r].to(F64) / temperature, -1)
        if exact[r]:
            terms = [math.exp(t) * (t - log_p[i]) for i, t in zip(topk_ids[r], topk_logprobs[r], strict=True) if i >= 0]
            rows.append(sum(terms, torch.zeros((), dtype=F64)))
        elif uld[r]:
            k = len(uld_teacher_logprobs[r])
            student = torch.sort(log_p.exp(), descending=True).values[:k]
            teacher = sorted((math.exp(t) for t in uld_teacher_logprobs[r]), reverse=True)
            rows.append(sum((abs(s - t) for s, t in zip(student, teacher, strict=True)), torch.zeros((), dtype=F64)))
        else:
            rows.append(torch.zeros((), dtype=F64))
    return torch.stack(rows)
