"""topk_kl against a float64 dense reference: verl's forward top-k KL and the renormalised ones."""

from __future__ import annotations

import pytest
import torch

from proctor.client.loss import topk_kl, topk_masses

from loss_reference import F64, make_case, rel_err, topk_of, topk_ref

TOL = 1e-5
CASES = [("forward", 0.5, None), ("forward", 0.5, -4.0), ("reverse", 0.5, None), ("jsd", 0.5, None), ("jsd", 0.1, None)]


def _teacher_topk(case, k):
    return topk_of(case.teacher_logits64, k)


@pytest.mark.parametrize("direction,beta,clamp", CASES)
def test_fused_topk_loss_and_gradients_match_float64_reference(direction, beta, clamp):
    case = make_case(n=31, h=16, v=199, seed=21, scale=2.0)
    ids, t = _teacher_topk(case, 8)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()
    weights = torch.rand(31, generator=torch.Generator().manual_seed(2))
    loss = topk_kl(
        ids, t.float(), student_hidden=sh, student_weight=sw, direction=direction, beta=beta,
        log_prob_min_clamp=clamp, chunk_tokens=6,
    )
    gh, gw = torch.autograd.grad((loss * weights).sum(), [sh, sw])
    rh_in = case.student_hidden.to(F64).requires_grad_()
    rw_in = case.student_weight.to(F64).requires_grad_()
    ref = topk_ref(rh_in @ rw_in.T, ids, t.float(), direction, beta, clamp=clamp)
    rh, rw = torch.autograd.grad((ref * weights.to(F64)).sum(), [rh_in, rw_in])
    assert loss.dtype == torch.float32 and loss.shape == (31,)
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gh, rh) <= TOL
    assert rel_err(gw, rw) <= TOL


@pytest.mark.parametrize("direction,beta,clamp", CASES)
def test_logits_form_topk_matches_float64_reference(direction, beta, clamp):
    case = make_case(n=17, h=16, v=83, seed=22, scale=2.0)
    ids, t = _teacher_topk(case, 5)
    logits = case.student_logits.detach().requires_grad_()
    loss = topk_kl(ids, t.float(), student_logits=logits, direction=direction, beta=beta, log_prob_min_clamp=clamp)
    (gl,) = torch.autograd.grad(loss.sum(), [logits])
    ref_in = case.student_logits.detach().to(F64).requires_grad_()
    ref = topk_ref(ref_in, ids, t.float(), direction, beta, clamp=clamp)
    (rl,) = torch.autograd.grad(ref.sum(), [ref_in])
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gl, rl) <= TOL


def test_forward_topk_is_verl_formula_without_renormalisation():
    case = make_case(n=9, h=8, v=40, seed=23)
    ids, t = _teacher_topk(case, 4)
    loss = topk_kl(ids, t.float(), student_logits=case.student_logits)
    s = torch.log_softmax(case.student_logits.to(F64), -1).gather(1, ids)
    expected = (t.exp() * (t - s)).sum(-1)
    assert rel_err(loss, expected) <= TOL
    # Top-k mass below 1 lets the unrenormalised forward KL go negative for some inputs.
    assert (t.exp().sum(-1) < 1).all()


@pytest.mark.parametrize("direction", ["forward", "reverse", "jsd"])
def test_temperature_matches_reference(direction):
    case = make_case(n=13, h=8, v=61, seed=24, scale=3.0)
    ids, t = _teacher_topk(case, 6)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()
    loss = topk_kl(ids, t.float(), student_hidden=sh, student_weight=sw, direction=direction, temperature=1.8)
    gh, gw = torch.autograd.grad(loss.sum(), [sh, sw])
    rh_in = case.student_hidden.to(F64).requires_grad_()
    rw_in = case.student_weight.to(F64).requires_grad_()
    ref = topk_ref(rh_in @ rw_in.T, ids, t.float(), direction, temperature=1.8)
    rh, rw = torch.autograd.grad(ref.sum(), [rh_in, rw_in])
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gh, rh) <= TOL
    assert rel_err(gw, rw) <= TOL


def test_forward_topk_is_invariant_to_chunk_tokens():
    case = make_case(n=23, h=8, v=70, seed=25)
    ids, t = _teacher_topk(case, 3)
    out = []
    for ct in (1, 5, 23, None):
        sh = case.student_hidden.clone().requires_grad_()
        loss = topk_kl(ids, t.float(), student_hidden=sh, student_weight=case.student_weight, chunk_tokens=ct)
        out.append((loss, torch.autograd.grad(loss.sum(), [sh])[0]))
    for loss, g in out[1:]:
        assert rel_err(loss, out[0][0]) <= 2e-6
        assert rel_err(g, out[0][1]) <= 2e-6


def test_clamp_floors_teacher_weight_too_as_verl_does():
    case = make_case(n=7, h=8, v=30, seed=26, scale=4.0)
    ids, t = _teacher_topk(case, 10)
    c = -3.0
    assert (t < c).any()  # some teacher log-probs lie below the floor
    loss = topk_kl(ids, t.float(), student_logits=case.student_logits, log_prob_min_clamp=c)
    s = torch.log_softmax(case.student_logits.to(F64), -1).gather(1, ids).clamp_min(c)
    tc = t.clamp_min(c)
    assert rel_err(loss, (tc.exp() * (tc - s)).sum(-1)) <= TOL


def test_bf16_student_gives_float32_loss_within_bf16_tolerance():
    case = make_case(n=15, h=32, v=90, seed=27, dtype=torch.bfloat16)
    ids, t = topk_of(case.teacher_logits64, 6)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()
    loss = topk_kl(ids, t.float(), student_hidden=sh, student_weight=sw)
    gh, gw = torch.autograd.grad(loss.sum(), [sh, sw])
    rh_in = case.student_hidden.to(F64).requires_grad_()
    rw_in = case.student_weight.to(F64).requires_grad_()
    ref = topk_ref(rh_in @ rw_in.T, ids, t.float())
    rh, rw = torch.autograd.grad(ref.sum(), [rh_in, rw_in])
    assert loss.dtype == torch.float32
    assert rel_err(loss, ref) <= 1e-5
    assert rel_err(gh, rh) <= 1e-2 and rel_err(gw, rw) <= 1e-2


@pytest.mark.parametrize("direction,clamp", [("forward", None), ("forward", -2.0), ("reverse", None), ("jsd", None)])
def test_float64_topk_passes_gradcheck(direction, clamp):
    case = make_case(n=4, h=4, v=12, seed=28, dtype=F64)
    ids, t = topk_of(case.teacher_logits64, 3)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()

    def fn(h, w):
        return topk_kl(
            ids, t, student_hidden=h, student_weight=w, direction=direction, log_prob_min_clamp=clamp,
            chunk_tokens=3,
        )

    assert torch.autograd.gradcheck(fn, (sh, sw), eps=1e-6, atol=1e-4, rtol=1e-3)


def test_topk_masses_are_the_probability_on_the_teacher_ids():
    case = make_case(n=6, h=8, v=25, seed=29)
    ids, t = _teacher_topk(case, 4)
    sm, tm = topk_masses(ids, t.float(), student_hidden=case.student_hidden, student_weight=case.student_weight)
    p = torch.softmax(case.student_logits64, -1).gather(1, ids).sum(-1)
    assert rel_err(sm, p) <= TOL
    assert rel_err(tm, t.exp().sum(-1)) <= TOL
