"""The full-vocabulary losses fed each compressed hidden-state form equal a float64 reference of
the same rebuilt teacher distribution (1e-5, gradients included), and the fp8 row rule itself.

Projected form: the teacher's logits are ``(h·P)·(W·P)ᵀ``; the loss takes ``h·P [N, r]`` and
``W·P [V, r]`` as an ordinary (hidden, weight) pair, so its gradient with respect to the student is
the usual one with the rebuilt teacher distribution ``q̃ = softmax(W·P·Pᵀ·h / τ)``: for the forward
KL, ``∂ℓ/∂z_S = (softmax(z_S/τ) − q̃) / τ`` and ``∂ℓ/∂h_S = W_Sᵀ·∂ℓ/∂z_S``. The reference below
builds ``W·P·Pᵀ·h`` densely in float64 and lets autograd differentiate it.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from proctor.client.loss import full_vocab_kl, full_vocab_kl_reduced
from proctor.proto import hidden_forms
from proctor.server.engines.hidden_forms import compress, projection_of

from loss_reference import F64, full_vocab_ref, make_case, rel_err

TOL = 1e-5
DIRECTIONS = [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.5)]


def test_fp8_rows_hold_each_rows_scale_after_its_values_and_round_within_e4m3s_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 40, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 7, dtype=torch.float64)[:, None]
    x[3] = 0.0  # an all-zero row: scale 1, values 0
    packed = hidden_forms.quantize_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 44)
    for row in range(7):
        (scale,) = struct.unpack("<f", bytes(packed[row, 40:].tolist()))
        amax = float(x[row].abs().max())
        assert scale == pytest.approx(amax / 448.0 if amax else 1.0, rel=1e-6)
    back = hidden_forms.dequantize_rows(packed, torch.float64)
    assert torch.equal(back[3], torch.zeros(40, dtype=torch.float64))
    # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal values; the
    # row's largest entry maps to 448 exactly.
    normal = x.abs() >= x.abs().amax(1, keepdim=True) * 2.0**-6 / 448.0 * 8
    rel = ((back - x).abs() / x.abs().clamp_min(1e-300))[normal & (x != 0)]
    assert float(rel.max()) <= 2.0**-4 + 1e-12
    assert torch.allclose(back.abs().amax(1)[x.abs().amax(1) > 0], x.abs().amax(1)[x.abs().amax(1) > 0], rtol=1e-6)


def test_projection_is_the_unembeddings_top_right_singular_subspace_and_its_energy():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 48, generator=g) @ torch.diag(torch.logspace(1, -2, 48))
    p = projection_of(w, 6)
    _, s, vt = np.linalg.svd(w.double().numpy(), full_matrices=False)  # an independent SVD
    top = torch.from_numpy(vt[:6].T)
    # Same subspace: the projectors agree; the columns are orthonormal.
    torch.testing.assert_close(p.matrix.double() @ p.matrix.double().T, top @ top.T, atol=1e-6, rtol=0)
    torch.testing.assert_close(p.matrix.double().T @ p.matrix.double(), torch.eye(6, dtype=F64), atol=1e-6, rtol=0)
    assert p.energy == pytest.approx(float((s[:6] ** 2).sum() / (s**2).sum()), rel=1e-9)
    assert torch.equal(projection_of(w, 6).matrix, p.matrix)  # deterministic: every process gets this P


def _case_and_forms(rank: int = 8):
    case = make_case(n=37, h=20, v=211, seed=3, h_teacher=32)
    th, tw = case.teacher_hidden, case.teacher_weight
    p = projection_of(tw, rank).matrix
    return case, {
        "float32": (compress(th, "float32", None), tw, th.double() @ tw.double().T),
        "bfloat16": (compress(th, "bfloat16", None), tw, th.to(torch.bfloat16).double() @ tw.double().T),
        "fp8": (compress(th, "fp8", None), tw,
                hidden_forms.dequantize_rows(compress(th, "fp8", None), F64) @ tw.double().T),
        "projected": (compress(th, "projected", p), tw.float() @ p,
                      (th.double() @ p.double()) @ (tw.double() @ p.double()).T),
        "projected_fp8": (compress(th, "projected_fp8", p), tw.float() @ p,
                          hidden_forms.dequantize_rows(compress(th, "projected_fp8", p), F64)
                          @ (tw.float() @ p).double().T),
    }


@pytest.mark.parametrize("form", hidden_forms.FORMS)
@pytest.mark.parametrize("direction,beta", DIRECTIONS)
def test_each_form_matches_float64_reference_of_its_rebuilt_distribution(form, direction, beta):
    case, forms = _case_and_forms()
    hidden, weight, teacher_logits64 = forms[form]
    sh = case.student_hidden.detach().clone().requires_grad_()
    sw = case.student_weight.detach().clone().requires_grad_()
    weights = torch.rand(37, generator=torch.Generator().manual_seed(7))
    loss = full_vocab_kl(hidden, weight, student_hidden=sh, student_weight=sw, direction=direction, beta=beta,
                         chunk_tokens=8, chunk_vocab=64)
    gh, gw = torch.autograd.grad((loss * weights).sum(), [sh, sw])
    rh = case.student_hidden.detach().double().requires_grad_()
    rw = case.student_weight.detach().double().requires_grad_()
    ref = full_vocab_ref(rh @ rw.T, teacher_logits64, direction=direction, beta=beta)
    ref_gh, ref_gw = torch.autograd.grad((ref * weights.double()).sum(), [rh, rw])
    assert rel_err(loss, ref) <= TOL
    assert rel_err(gh, ref_gh) <= TOL
    assert rel_err(gw, ref_gw) <= TOL
    # The reduced entry (gradients formed in its forward pass) agrees too.
    sh2 = case.student_hidden.detach().clone().requires_grad_()
    sw2 = case.student_weight.detach().clone().requires_grad_()
    out = full_vocab_kl_reduced(hidden, weight, weights, student_hidden=sh2, student_weight=sw2,
                                direction=direction, beta=beta)
    g2h, g2w = torch.autograd.grad(out.total, [sh2, sw2])
    assert rel_err(out.total, (ref * weights.double()).sum()) <= TOL
    assert rel_err(g2h, ref_gh) <= TOL and rel_err(g2w, ref_gw) <= TOL


def test_fp8_rows_in_float64_inputs_are_exact_in_float64():
    """With float64 student inputs the loss computes in float64 and dequantises into it: a float64
    gradcheck-grade match of the same rebuilt distribution."""
    case, forms = _case_and_forms()
    hidden, weight, teacher_logits64 = forms["fp8"]
    sh = case.student_hidden.double().requires_grad_()
    sw = case.student_weight.double()
    loss = full_vocab_kl(hidden, weight.double(), student_hidden=sh, student_weight=sw, chunk_tokens=5)
    ref = full_vocab_ref(sh @ sw.T, teacher_logits64)
    assert loss.dtype == F64
    assert rel_err(loss, ref) <= 1e-12


def test_the_projected_gradient_is_the_students_softmax_minus_the_rebuilt_teachers():
    """The gradient formula, checked against its closed form: d(forward KL)/dz_S = p_S − q̃."""
    case, forms = _case_and_forms()
    hidden, weight, _ = forms["projected"]
    logits = (case.student_hidden.double() @ case.student_weight.double().T).requires_grad_()
    loss = full_vocab_kl(hidden.double(), weight.double(), student_logits=logits)
    (grad,) = torch.autograd.grad(loss.sum(), [logits])
    rebuilt = hidden.double() @ weight.double().T  # (h·P)·(W·P)ᵀ as sent
    closed = torch.softmax(logits.detach(), -1) - torch.softmax(rebuilt, -1)
    assert rel_err(grad, closed) <= 1e-12


def test_packed_rows_of_several_teachers_are_dequantised_by_group():
    case, forms = _case_and_forms()
    hidden, weight, teacher_logits64 = forms["fp8"]
    index = torch.arange(37) % 2
    sh = case.student_hidden.detach().clone()
    sw = case.student_weight.detach().clone()
    loss = full_vocab_kl(hidden, [weight, weight], teacher_index=index, student_hidden=sh, student_weight=sw)
    ref = full_vocab_ref(sh.double() @ sw.double().T, teacher_logits64)
    assert rel_err(loss, ref) <= TOL


def test_a_packed_teacher_is_checked_at_its_logical_width():
    case, forms = _case_and_forms()
    hidden, _, _ = forms["fp8"]
    with pytest.raises(ValueError, match="hidden size 32 but teacher_weight has 31"):
        full_vocab_kl(hidden, case.teacher_weight[:, :31], student_hidden=case.student_hidden,
                      student_weight=case.student_weight)


def test_packed_rows_batch_with_packed_rows_of_one_width_only():
    """client.batch pads narrower teachers' rows at their end, which would move a packed row's
    scale: packed rows batch with packed rows of one width, and come out as they went in."""
    from proctor.client.batch import hidden_states_batch
    from proctor.client.client import TeacherScores

    def scores(teacher: str, hidden: torch.Tensor) -> TeacherScores:
        return TeacherScores("r", teacher, "m", hidden.shape[0] + 1, 1, hidden_states=hidden)

    g = torch.Generator().manual_seed(4)
    a, b = hidden_forms.quantize_rows(torch.randn(5, 16, generator=g)), hidden_forms.quantize_rows(torch.randn(3, 16, generator=g))
    packed, _ = hidden_states_batch([scores("t", a), scores("t", b)]).packed()
    assert torch.equal(packed, torch.cat([a, b]))
    with pytest.raises(ValueError, match="packed fp8 hidden rows"):
        hidden_states_batch([scores("t", a), scores("u", hidden_forms.quantize_rows(torch.randn(2, 8, generator=g)))])
    with pytest.raises(ValueError, match="packed fp8 hidden rows"):
        hidden_states_batch([scores("t", a), scores("u", torch.randn(2, 16, generator=g))])
