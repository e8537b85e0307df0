"""student_topk_reverse_kl against a float64 dense reference: the exact terms of the reverse KL
on the student's top-k support and its renormalised form, values and gradients."""

from __future__ import annotations

import pytest
import torch

from proctor.client.loss import distillation_loss, student_topk_masses, student_topk_reverse_kl

from loss_reference import F64, make_case, rel_err, student_topk_ref

TOL = 1e-5
FORMS = ("exact", "renormalised")


def _support(case, k: int, *, pad: bool = True):
    """The student's top-k ids (padded at the ends of some rows, one row empty) and the
    teacher's full-vocabulary log-probs at them (what a server sends as score_logprobs)."""
    ids = torch.topk(case.student_logits64, k, dim=-1).indices
    if pad:
        ids[::3, k - 2 :] = -1
        ids[1] = -1
    teacher = torch.log_softmax(case.teacher_logits64, dim=-1).gather(1, ids.clamp_min(0))
    return ids.to(torch.int32), teacher.masked_fill(ids < 0, float("-inf")).float()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_fused_loss_and_gradients_match_float64_reference(form, temperature):
    case = make_case(n=29, h=16, v=211, seed=31, scale=2.0)
    ids, teacher = _support(case, 8)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()
    weights = torch.rand(29, generator=torch.Generator().manual_seed(3))
    loss = student_topk_reverse_kl(ids, teacher, student_hidden=sh, student_weight=sw, form=form,
                                   temperature=temperature, chunk_tokens=7)
    gh, gw = torch.autograd.grad((loss * weights).sum(), [sh, sw])
    rh_in = case.student_hidden.to(F64).requires_grad_()
    rw_in = case.student_weight.to(F64).requires_grad_()
    ref = student_topk_ref(rh_in @ rw_in.T, ids, teacher, form, temperature)
    rh, rw = torch.autograd.grad((ref * weights.to(F64)).sum(), [rh_in, rw_in])
    assert loss.dtype == torch.float32 and loss.shape == (29,)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert loss[1].item() == 0.0  # a row without a valid id
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gh, rh) <= TOL
    assert rel_err(gw, rw) <= TOL


@pytest.mark.parametrize("form", FORMS)
def test_logits_form_matches_float64_reference(form):
    case = make_case(n=13, h=16, v=97, seed=32, scale=2.0)
    ids, teacher = _support(case, 6)
    logits = case.student_logits.clone().requires_grad_()
    loss = student_topk_reverse_kl(ids, teacher, student_logits=logits, form=form)
    (g,) = torch.autograd.grad(loss.sum(), [logits])
    ref_in = case.student_logits64.clone().requires_grad_()
    ref = student_topk_ref(ref_in, ids, teacher, form)
    (rg,) = torch.autograd.grad(ref.sum(), [ref_in])
    assert rel_err(loss, ref) <= TOL and rel_err(g, rg) <= TOL


@pytest.mark.parametrize("form", FORMS)
def test_float64_passes_gradcheck(form):
    case = make_case(n=6, h=5, v=23, seed=33, dtype=F64)
    ids, teacher = _support(case, 4)
    sh = case.student_hidden.clone().requires_grad_()
    sw = case.student_weight.clone().requires_grad_()

    def fn(h, w):
        return student_topk_reverse_kl(ids, teacher.double(), student_hidden=h, student_weight=w, form=form,
                                       chunk_tokens=4)

    assert torch.autograd.gradcheck(fn, (sh, sw), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_exact_form_on_the_whole_vocabulary_is_the_full_reverse_kl():
    case = make_case(n=9, h=16, v=64, seed=34, scale=2.0)
    ids = torch.arange(64).repeat(9, 1)
    teacher = torch.log_softmax(case.teacher_logits64, dim=-1)
    loss = student_topk_reverse_kl(ids, teacher.float(), student_hidden=case.student_hidden,
                                   student_weight=case.student_weight)
    log_p = torch.log_softmax(case.student_logits64, dim=-1)
    full = (log_p.exp() * (log_p - teacher)).sum(-1)
    assert rel_err(loss, full) <= TOL
    # And on a strict subset the exact form sees less than the full KL's positive mass: the
    # student's mass outside the support is what the masses report.
    sub, t_sub = _support(case, 8, pad=False)
    student_mass, teacher_mass = student_topk_masses(sub, t_sub, student_hidden=case.student_hidden,
                                                     student_weight=case.student_weight)
    expected_s = log_p.exp().gather(1, sub.long()).sum(-1)
    expected_t = teacher.exp().gather(1, sub.long()).sum(-1)
    assert rel_err(student_mass, expected_s) <= TOL and rel_err(teacher_mass, expected_t) <= TOL
    assert (student_mass < 1).all() and (student_mass > 0).all()


def test_inputs_are_checked_by_name():
    case = make_case(n=4, h=8, v=31, seed=35)
    ids, teacher = _support(case, 3, pad=False)
    student = {"student_hidden": case.student_hidden, "student_weight": case.student_weight}
    with pytest.raises(ValueError, match="teacher_score_logprobs has \\(4, 2\\)"):
        student_topk_reverse_kl(ids, teacher[:, :2], **student)
    with pytest.raises(ValueError, match="student_topk_ids has ids"):
        student_topk_reverse_kl(ids + 31, teacher, **student)
    with pytest.raises(ValueError, match="form"):
        student_topk_reverse_kl(ids, teacher, **student, form="dense")
    with pytest.raises(ValueError, match="integer"):
        student_topk_reverse_kl(ids.float(), teacher, **student)


@pytest.mark.parametrize("form", FORMS)
def test_distillation_loss_mode_with_its_metrics(form):
    case = make_case(n=21, h=16, v=101, seed=36, scale=2.0)
    ids, teacher = _support(case, 6)
    mask = torch.ones(21, dtype=torch.bool)
    mask[-4:] = False
    config = {"loss_mode": "student_topk_reverse_kl", "topk": 6, "student_topk_form": form,
              "use_task_rewards": False}
    sh = case.student_hidden.clone().requires_grad_()
    out = distillation_loss(config, mask=mask, student_hidden=sh, student_weight=case.student_weight,
                            student_topk_ids=ids, teacher_score_logprobs=teacher)
    ref = student_topk_ref(case.student_logits64, ids, teacher, form)
    assert rel_err(out.per_token_loss, ref) <= TOL
    assert abs(out.loss.item() - ref[mask].mean().item()) <= TOL * abs(ref[mask].mean().item()) + 1e-7
    out.loss.backward()
    assert torch.isfinite(sh.grad).all() and sh.grad.abs().sum() > 0
    log_p = torch.log_softmax(case.student_logits64, dim=-1)
    valid = (ids >= 0)[mask]
    on_support = log_p.exp().gather(1, ids.long().clamp_min(0))[mask]
    assert out.metrics["student_mass"] == pytest.approx((on_support * valid).sum(-1).mean().item(), rel=1e-5)
    assert 0 < out.metrics["teacher_mass"] < 1
    with pytest.raises(ValueError, match="student_topk_ids and teacher_score_logprobs"):
        distillation_loss(config, student_hidden=sh, student_weight=case.student_weight)
    with pytest.raises(ValueError, match="student_topk_form"):
        distillation_loss({**config, "student_topk_form": "x"}, student_hidden=sh, student_weight=case.student_weight,
                          student_topk_ids=ids, teacher_score_logprobs=teacher)
