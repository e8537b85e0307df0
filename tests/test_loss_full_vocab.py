"""full_vocab_kl against a float64 dense reference: values, gradients, chunking, dtypes."""

from __future__ import annotations

import pytest
import torch

from proctor.client.loss import full_vocab_kl

from loss_reference import F64, full_vocab_ref, make_case, rel_err

DIRECTIONS = [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.5), ("jsd", 0.2), ("jsd", 0.9)]
TOL = 1e-5


def _fused(case, dtype=torch.float32):
    sh = case.student_hidden.detach().to(dtype).requires_grad_()
    sw = case.student_weight.detach().to(dtype).requires_grad_()
    return sh, sw


def _ref_fused_grads(case, weights, **kw):
    """Reference loss and gradients w.r.t. student hidden / weight, float64."""
    sh = case.student_hidden.detach().to(F64).requires_grad_()
    sw = case.student_weight.detach().to(F64).requires_grad_()
    ref = full_vocab_ref(sh @ sw.T, case.teacher_logits64, **kw)
    gh, gw = torch.autograd.grad((ref * weights.to(F64)).sum(), [sh, sw])
    return ref.detach(), gh, gw


@pytest.mark.parametrize("direction,beta", DIRECTIONS)
def test_fused_loss_and_gradients_match_float64_reference(direction, beta):
    case = make_case(n=33, h=24, v=301, seed=1)
    sh, sw = _fused(case)
    weights = torch.rand(33, generator=torch.Generator().manual_seed(5))
    loss = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
        direction=direction, beta=beta, chunk_tokens=8, chunk_vocab=64,
    )
    gh, gw = torch.autograd.grad((loss * weights).sum(), [sh, sw])
    ref, rh, rw = _ref_fused_grads(case, weights, direction=direction, beta=beta)
    assert loss.dtype == torch.float32 and loss.shape == (33,)
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gh, rh) <= TOL
    assert rel_err(gw, rw) <= TOL


@pytest.mark.parametrize("direction,beta", DIRECTIONS)
def test_student_logits_form_matches_float64_reference(direction, beta):
    case = make_case(n=21, h=16, v=157, seed=2)
    logits = case.student_logits.detach().requires_grad_()
    weights = torch.randn(21, generator=torch.Generator().manual_seed(6))
    loss = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_logits=logits,
        direction=direction, beta=beta, chunk_tokens=5, chunk_vocab=40,
    )
    (gl,) = torch.autograd.grad((loss * weights).sum(), [logits])
    ref_logits = case.student_logits.detach().to(F64).requires_grad_()
    ref = full_vocab_ref(ref_logits, case.teacher_logits64, direction=direction, beta=beta)
    (rl,) = torch.autograd.grad((ref * weights.to(F64)).sum(), [ref_logits])
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gl, rl) <= TOL


@pytest.mark.parametrize("direction", ["forward", "reverse", "jsd"])
def test_result_is_invariant_to_chunk_sizes_that_do_not_divide_n_or_v(direction):
    case = make_case(n=37, h=16, v=211, seed=3)
    results = []
    for ct, cv in [(37, 211), (1, 211), (5, 17), (36, 210), (1000, 1000), (None, None)]:
        sh, sw = _fused(case)
        loss = full_vocab_kl(
            case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
            direction=direction, chunk_tokens=ct, chunk_vocab=cv,
        )
        gh, gw = torch.autograd.grad(loss.sum(), [sh, sw])
        results.append((loss, gh, gw))
    base = results[0]
    for other in results[1:]:
        for x, y in zip(other, base, strict=True):
            assert rel_err(x, y) <= 2e-6


@pytest.mark.parametrize("direction", ["forward", "reverse", "jsd"])
def test_temperature_divides_both_sides_logits(direction):
    case = make_case(n=19, h=16, v=89, seed=4, scale=3.0)
    weights = torch.ones(19)
    sh, sw = _fused(case)
    loss = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
        direction=direction, temperature=2.5, chunk_tokens=7, chunk_vocab=30,
    )
    gh, gw = torch.autograd.grad(loss.sum(), [sh, sw])
    ref, rh, rw = _ref_fused_grads(case, weights, direction=direction, temperature=2.5)
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gh, rh) <= TOL
    assert rel_err(gw, rw) <= TOL


def test_forward_clamp_floors_student_log_probs_in_value_and_gradient():
    # A large logit spread puts many student log-probs below the floor.
    case = make_case(n=23, h=16, v=131, seed=5, scale=4.0)
    weights = torch.rand(23, generator=torch.Generator().manual_seed(1))
    sh, sw = _fused(case)
    loss = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
        log_prob_min_clamp=-6.0, chunk_tokens=6, chunk_vocab=50,
    )
    gh, gw = torch.autograd.grad((loss * weights).sum(), [sh, sw])
    ref, rh, rw = _ref_fused_grads(case, weights, clamp=-6.0)
    unclamped = full_vocab_ref(case.student_logits64, case.teacher_logits64)
    assert rel_err(ref, unclamped) > 1e-3  # the floor binds in this case
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gh, rh) <= TOL
    assert rel_err(gw, rw) <= TOL


def test_clamp_with_single_vocab_tile_matches_multi_tile():
    case = make_case(n=17, h=16, v=101, seed=6, scale=4.0)
    out = []
    for cv in (101, 13):
        sh, sw = _fused(case)
        loss = full_vocab_kl(
            case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
            log_prob_min_clamp=-5.0, chunk_vocab=cv,
        )
        out.append((loss, *torch.autograd.grad(loss.sum(), [sh, sw])))
    for x, y in zip(out[0], out[1], strict=True):
        assert rel_err(x, y) <= 2e-6


def test_masked_tokens_contribute_nothing_to_gradients():
    case = make_case(n=20, h=16, v=77, seed=7)
    mask = torch.zeros(20, dtype=torch.bool)
    mask[3:9] = True
    sh, sw = _fused(case)
    loss = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw, chunk_tokens=4,
    )
    gh, gw = torch.autograd.grad(torch.where(mask, loss, 0.0).sum(), [sh, sw])
    sub_h = case.student_hidden[3:9].detach().clone().requires_grad_()
    sw2 = case.student_weight.detach().clone().requires_grad_()
    sub = full_vocab_kl(
        case.teacher_hidden[3:9], case.teacher_weight, student_hidden=sub_h, student_weight=sw2,
    )
    sh_sub, sw_sub = torch.autograd.grad(sub.sum(), [sub_h, sw2])
    assert torch.count_nonzero(gh[~mask]) == 0
    assert rel_err(gh[mask], sh_sub) <= 2e-6
    assert rel_err(gw, sw_sub) <= 2e-6


@pytest.mark.parametrize("direction", ["forward", "reverse", "jsd"])
def test_bf16_inputs_give_float32_loss_within_bf16_tolerance(direction):
    case = make_case(n=25, h=32, v=120, seed=8, dtype=torch.bfloat16)
    sh, sw = _fused(case, torch.bfloat16)
    loss = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
        direction=direction, chunk_tokens=8, chunk_vocab=50,
    )
    gh, gw = torch.autograd.grad(loss.sum(), [sh, sw])
    # Reference on the same bf16-rounded inputs, in float64.
    ref, rh, rw = _ref_fused_grads(case, torch.ones(25), direction=direction)
    assert loss.dtype == torch.float32
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert rel_err(loss, ref) <= 1e-5  # float32 accumulation: exact up to float32
    assert rel_err(gh, rh) <= 1e-2  # gradients are rounded to bf16 on return
    assert rel_err(gw, rw) <= 1e-2


def test_float64_inputs_pass_gradcheck():
    case = make_case(n=5, h=4, v=11, seed=9, dtype=F64)
    sh, sw = _fused(case, F64)
    th, tw = case.teacher_hidden, case.teacher_weight
    for direction, clamp in (("forward", None), ("forward", -2.5), ("reverse", None), ("jsd", None)):

        def fn(h, w, direction=direction, clamp=clamp):
            return full_vocab_kl(
                th, tw, student_hidden=h, student_weight=w, direction=direction,
                log_prob_min_clamp=clamp, chunk_tokens=2, chunk_vocab=4,
            )

        assert torch.autograd.gradcheck(fn, (sh, sw), eps=1e-6, atol=1e-4, rtol=1e-3)


def test_float64_logits_form_passes_gradcheck():
    case = make_case(n=4, h=4, v=9, seed=10, dtype=F64)
    logits = case.student_logits.detach().requires_grad_()

    def fn(z):
        return full_vocab_kl(
            case.teacher_hidden, case.teacher_weight, student_logits=z, direction="jsd", beta=0.3,
            chunk_tokens=3, chunk_vocab=4,
        )

    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-4, rtol=1e-3)


def test_teacher_receives_no_gradient():
    case = make_case(n=6, h=8, v=30, seed=11)
    th = case.teacher_hidden.clone().requires_grad_()
    tw = case.teacher_weight.clone().requires_grad_()
    sh, sw = _fused(case)
    loss = full_vocab_kl(th, tw, student_hidden=sh, student_weight=sw)
    loss.sum().backward()
    assert th.grad is None and tw.grad is None
    assert sh.grad is not None and sw.grad is not None


def test_frozen_student_weight_gets_no_gradient_but_hidden_does():
    case = make_case(n=6, h=8, v=30, seed=12)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone()
    loss = full_vocab_kl(case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw)
    loss.sum().backward()
    assert sh.grad is not None and sw.grad is None


@pytest.mark.parametrize("beta,direction", [(0.0, "forward"), (1.0, "reverse")])
def test_jsd_endpoints_are_the_forward_and_reverse_kl(beta, direction):
    case = make_case(n=9, h=8, v=40, seed=13)
    sh, sw = _fused(case)
    jsd = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
        direction="jsd", beta=beta,
    )
    kl = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw, direction=direction,
    )
    assert torch.equal(jsd, kl)


def test_identical_student_and_teacher_give_zero_loss_and_gradient():
    case = make_case(n=8, h=8, v=50, seed=14)
    sh = case.teacher_hidden.clone().requires_grad_()
    sw = case.teacher_weight.clone().requires_grad_()
    loss = full_vocab_kl(
        case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw, direction="jsd",
    )
    loss.sum().backward()
    assert loss.abs().max() < 1e-6
    assert sh.grad.abs().max() < 1e-5
