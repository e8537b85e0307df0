"""The fused paths never create a tensor as large as [N, V], forward or backward."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from proctor.client.loss import full_vocab_kl, full_vocab_kl_reduced, topk_kl, topk_kl_reduced

from loss_reference import make_case, topk_of

N, H, V = 64, 8, 500
CT, CV = 16, 50


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


def _largest_during(fn) -> int:
    mode = _LargestTensor()
    with mode:
        fn()
    return mode.largest


def test_fused_full_vocab_forward_and_backward_stay_below_n_times_v():
    case = make_case(n=N, h=H, v=V, seed=51)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()

    def run():
        for direction in ("forward", "reverse", "jsd"):
            loss = full_vocab_kl(
                case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
                direction=direction, chunk_tokens=CT, chunk_vocab=CV,
            )
            loss.sum().backward()

    largest = _largest_during(run)
    # The weight gradient [V, H] is the largest thing that must exist; a tile is CT x CV.
    assert largest <= max(V * H, CT * CV, N * H)
    assert largest < N * V


def test_fused_topk_forward_and_backward_stay_below_n_times_v():
    case = make_case(n=N, h=H, v=V, seed=52)
    ids, lps = topk_of(case.teacher_logits64, 4)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()

    def run():
        loss = topk_kl(ids, lps.float(), student_hidden=sh, student_weight=sw, log_prob_min_clamp=-8.0, chunk_tokens=CT)
        loss.sum().backward()

    largest = _largest_during(run)
    assert largest < N * V


def test_fused_reduced_losses_hold_row_chunks_not_n_times_v():
    # Whole-vocabulary rows of CT tokens at a time, the per-token output's backward included.
    case = make_case(n=N, h=H, v=V, seed=53)
    ids, lps = topk_of(case.teacher_logits64, 4)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()
    weights = torch.rand(N, generator=torch.Generator().manual_seed(5))

    def run():
        for direction in ("forward", "reverse", "jsd"):
            red = full_vocab_kl_reduced(case.teacher_hidden, case.teacher_weight, weights, student_hidden=sh,
                                        student_weight=sw, direction=direction, chunk_tokens=CT)
            (red.total + red.per_token.sum()).backward()
        red = topk_kl_reduced(ids, lps.float(), weights, student_hidden=sh, student_weight=sw, chunk_tokens=CT)
        (red.total + red.per_token.sum()).backward()

    largest = _largest_during(run)
    assert largest <= max(V * H, CT * V, N * H)
    assert largest < N * V
