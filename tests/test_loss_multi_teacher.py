"""Multi-teacher full-vocabulary KL: per-token teacher selection by teacher_index."""

from __future__ import annotations

import pytest
import torch

from proctor.client.loss import full_vocab_kl

from loss_reference import F64, full_vocab_ref, make_case, rel_err


def _two_teachers(n=24, v=60):
    a = make_case(n=n, h=12, v=v, seed=31)
    b = make_case(n=n, h=12, v=v, seed=32, h_teacher=8)
    index = torch.tensor([0, 1] * (n // 2))
    hidden = a.teacher_hidden.clone()
    hidden[index == 1, :8] = b.teacher_hidden[index == 1]
    hidden[index == 1, 8:] = 0.0  # padding beyond teacher 1's hidden size is ignored
    return a, b, index, hidden


def test_each_token_uses_its_own_teachers_hidden_row_and_weight():
    a, b, index, hidden = _two_teachers()
    sh = a.student_hidden.clone().requires_grad_()
    sw = a.student_weight.clone().requires_grad_()
    loss = full_vocab_kl(
        hidden, [a.teacher_weight, b.teacher_weight], teacher_index=index,
        student_hidden=sh, student_weight=sw, direction="reverse", chunk_tokens=5, chunk_vocab=17,
    )
    gh, gw = torch.autograd.grad(loss.sum(), [sh, sw])
    rh = a.student_hidden.to(F64).requires_grad_()
    rw = a.student_weight.to(F64).requires_grad_()
    t_logits = torch.where(
        (index == 0)[:, None], a.teacher_logits64, hidden[:, :8].to(F64) @ b.teacher_weight.to(F64).T
    )
    ref = full_vocab_ref(rh @ rw.T, t_logits, "reverse")
    ref_h, ref_w = torch.autograd.grad(ref.sum(), [rh, rw])
    assert rel_err(loss, ref) <= 1e-5
    assert rel_err(gh, ref_h) <= 1e-5
    assert rel_err(gw, ref_w) <= 1e-5


def test_token_whose_teacher_has_no_weight_raises():
    a, _, index, hidden = _two_teachers()
    with pytest.raises(ValueError, match="teacher 1"):
        full_vocab_kl(
            hidden, [a.teacher_weight, None], teacher_index=index,
            student_hidden=a.student_hidden, student_weight=a.student_weight,
        )


def test_teacher_without_weight_is_fine_when_no_token_selects_it():
    a, _, index, hidden = _two_teachers()
    zeros = torch.zeros_like(index)
    loss = full_vocab_kl(
        hidden, [a.teacher_weight, None], teacher_index=zeros,
        student_hidden=a.student_hidden, student_weight=a.student_weight,
    )
    assert rel_err(loss, full_vocab_ref(a.student_logits64, hidden.to(F64) @ a.teacher_weight.to(F64).T)) <= 1e-5


def test_teacher_index_out_of_range_raises_naming_it():
    a, b, index, hidden = _two_teachers()
    with pytest.raises(ValueError, match="teacher_index"):
        full_vocab_kl(
            hidden, [a.teacher_weight, b.teacher_weight], teacher_index=index + 1,
            student_hidden=a.student_hidden, student_weight=a.student_weight,
        )


def test_several_weights_without_teacher_index_raise():
    a, b, _, hidden = _two_teachers()
    with pytest.raises(ValueError, match="teacher_index"):
        full_vocab_kl(
            hidden, [a.teacher_weight, b.teacher_weight],
            student_hidden=a.student_hidden, student_weight=a.student_weight,
        )
