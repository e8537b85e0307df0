"""sampled_kl: verl's single-sample estimators, values and gradients."""

from __future__ import annotations

import pytest
import torch

from proctor.client.loss import SAMPLED_MODES, sampled_kl

from loss_reference import F64, rel_err, sampled_ref


def _logprobs(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(n, generator=g) * 6, -torch.rand(n, generator=g) * 6


@pytest.mark.parametrize("mode", SAMPLED_MODES)
def test_value_and_gradient_match_float64_reference(mode):
    s, t = _logprobs(seed=1)
    s = s.requires_grad_()
    loss = sampled_kl(s, t, mode)
    (g,) = torch.autograd.grad(loss.sum(), [s])
    s64 = s.detach().to(F64).requires_grad_()
    ref = sampled_ref(s64, t, mode)
    (rg,) = torch.autograd.grad(ref.sum(), [s64])
    assert loss.dtype == torch.float32
    assert rel_err(loss, ref) <= 1e-6
    assert rel_err(g, rg) <= 1e-6


def test_k3_is_clamped_to_ten_and_stays_finite_for_extreme_log_ratios():
    s = torch.tensor([0.0, -30.0, 0.0, -2000.0, -1.0], requires_grad=True)
    t = torch.tensor([-30.0, 0.0, -2000.0, 0.0, -3.0])
    out = sampled_kl(s, t, "k3")
    out.sum().backward()
    assert out[:4].tolist() == [10.0, 10.0, 10.0, 10.0]
    assert out[4].item() == pytest.approx(float(torch.exp(torch.tensor(-2.0))) + 1.0, rel=1e-6)
    assert torch.isfinite(s.grad).all()
    assert s.grad[:4].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_teacher_log_probs_receive_no_gradient():
    s = torch.tensor([-1.0, -2.0], requires_grad=True)
    t = torch.tensor([-1.5, -0.5], requires_grad=True)
    sampled_kl(s, t, "k2").sum().backward()
    assert t.grad is None and s.grad is not None


def test_aliases_agree():
    s, t = _logprobs(seed=2)
    assert torch.equal(sampled_kl(s, t, "kl"), sampled_kl(s, t, "k1"))
    assert torch.equal(sampled_kl(s, t, "mse"), sampled_kl(s, t, "k2"))
    assert torch.equal(sampled_kl(s, t, "low_var_kl"), sampled_kl(s, t, "k3"))


def test_bf16_inputs_are_computed_in_float32():
    s, t = _logprobs(seed=3)
    out = sampled_kl(s.bfloat16(), t.bfloat16(), "k3")
    ref = sampled_ref(s.bfloat16(), t.bfloat16(), "k3")
    assert out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-6
