"""distillation_loss: verl 0.9.1's distillation_loss behaviour, verl-omni modes, mixing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from proctor.client.loss import aggregate, distillation_loss, full_vocab_kl, sampled_kl, topk_kl

from loss_reference import full_vocab_ref, make_case, rel_err, topk_of


def _sampled(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = (-torch.rand(n, generator=g) * 8).requires_grad_()
    t = -torch.rand(n, generator=g) * 8
    return s, t


def test_config_may_be_a_dict_or_an_object():
    s, t = _sampled()
    cfg = {"loss_mode": "k3", "use_policy_gradient": False}
    a = distillation_loss(cfg, student_logprobs=s, teacher_logprobs=t)
    b = distillation_loss(SimpleNamespace(**cfg), student_logprobs=s, teacher_logprobs=t)
    assert torch.equal(a.loss, b.loss)


def test_enclosing_distillation_block_is_accepted():
    s, t = _sampled()
    out = distillation_loss(
        {"distillation_loss": {"loss_mode": "k2", "use_policy_gradient": False}},
        student_logprobs=s, teacher_logprobs=t,
    )
    assert out.settings.loss_mode == "k2"


def test_k1_cannot_be_supervised():
    with pytest.raises(ValueError, match="k1"):
        distillation_loss({"loss_mode": "k1", "use_policy_gradient": False})


@pytest.mark.parametrize("mode", ["nitrobrew", "nitrobrew_reverse_kl", "full_jsd"])
def test_hidden_state_modes_cannot_be_policy_gradient(mode):
    with pytest.raises(ValueError, match="use_policy_gradient"):
        distillation_loss({"loss_mode": mode, "use_policy_gradient": True})


def test_unknown_loss_mode_raises_listing_modes():
    with pytest.raises(ValueError, match="loss_mode"):
        distillation_loss({"loss_mode": "kl_topk"})


def test_misspelt_setting_raises():
    with pytest.raises(ValueError, match="loss_mod"):
        distillation_loss({"loss_mod": "k3"})


def test_non_vanilla_policy_loss_is_not_implemented():
    with pytest.raises(NotImplementedError):
        distillation_loss({"loss_mode": "k3", "policy_loss_mode": "gspo"})


def test_per_token_loss_is_clamped_to_loss_max_clamp_both_ways():
    s, t = _sampled()
    s = torch.tensor([0.0, -20.0, -1.0], requires_grad=True)
    t = torch.tensor([-20.0, 0.0, -1.5])
    out = distillation_loss({"loss_mode": "k1", "use_policy_gradient": True, "loss_max_clamp": 5.0}, student_logprobs=s, teacher_logprobs=t)
    assert out.per_token_loss.tolist() == [5.0, -5.0, 0.5]


def test_loss_range_metrics_are_taken_before_the_clamp():
    s = torch.tensor([0.0, -20.0, -1.0])
    t = torch.tensor([-20.0, 0.0, -1.5])
    out = distillation_loss({"loss_mode": "k1", "use_policy_gradient": True, "loss_max_clamp": 5.0}, student_logprobs=s, teacher_logprobs=t)
    assert out.metrics["loss_max"] == 20.0 and out.metrics["loss_min"] == -20.0


def test_policy_gradient_mode_returns_detached_penalty_and_no_loss():
    s, t = _sampled()
    out = distillation_loss({"loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": False}, student_logprobs=s, teacher_logprobs=t)
    assert out.loss is None
    assert not out.advantage_penalty.requires_grad
    assert torch.allclose(out.advantage_penalty, sampled_kl(s, t, "k1").clamp(-10, 10))


def test_coefficient_applies_only_with_task_rewards():
    s, t = _sampled()
    base = {"loss_mode": "k3", "use_policy_gradient": False, "distillation_loss_coef": 0.25}
    with_rewards = distillation_loss({**base, "use_task_rewards": True}, student_logprobs=s, teacher_logprobs=t)
    without = distillation_loss({**base, "use_task_rewards": False}, student_logprobs=s, teacher_logprobs=t)
    assert with_rewards.loss.item() == pytest.approx(0.25 * without.loss.item())


def test_supervised_loss_is_masked_token_mean_by_default():
    s, t = _sampled()
    mask = torch.tensor([1, 1, 1, 0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    out = distillation_loss(
        {"loss_mode": "k3", "use_policy_gradient": False, "use_task_rewards": False},
        mask=mask, student_logprobs=s, teacher_logprobs=t,
    )
    expected = aggregate(sampled_kl(s, t, "k3"), mask)
    assert out.loss.item() == pytest.approx(expected.item())
    (g,) = torch.autograd.grad(out.loss, [s])
    assert torch.count_nonzero(g[~mask]) == 0


def test_gkd_ratio_mixes_rl_and_distillation_losses():
    s, t = _sampled()
    out = distillation_loss(
        {"loss_mode": "k3", "use_policy_gradient": False, "gkd_ratio": 0.3},
        student_logprobs=s, teacher_logprobs=t,
    )
    rl = torch.tensor(2.0)
    assert out.combine(rl).item() == pytest.approx(0.7 * 2.0 + 0.3 * out.loss.item())


def test_pg_ratio_scales_the_advantage_penalty():
    s, t = _sampled()
    plain = distillation_loss({"loss_mode": "k1", "use_policy_gradient": True}, student_logprobs=s, teacher_logprobs=t)
    scaled = distillation_loss({"loss_mode": "k1", "use_policy_gradient": True, "pg_ratio": 0.5}, student_logprobs=s, teacher_logprobs=t)
    assert torch.allclose(scaled.advantage_penalty, 0.5 * plain.advantage_penalty)


def test_with_task_rewards_supervised_loss_adds_to_rl_loss():
    s, t = _sampled()
    out = distillation_loss(
        {"loss_mode": "k3", "use_policy_gradient": False, "distillation_loss_coef": 0.5},
        student_logprobs=s, teacher_logprobs=t,
    )
    assert out.combine(torch.tensor(1.0)).item() == pytest.approx(1.0 + out.loss.item())


def test_forward_kl_topk_is_floored_at_zero_per_token():
    case = make_case(n=40, h=8, v=50, seed=41, scale=2.0)
    ids, lps = topk_of(case.teacher_logits64, 2)
    # A student sharper than the teacher puts more mass on the top-k: the top-k KL goes negative.
    student = (case.teacher_logits64 * torch.linspace(0.5, 2.0, 40, dtype=torch.float64)[:, None]).float()
    cfg = {"loss_mode": "forward_kl_topk", "use_policy_gradient": False, "topk": 2, "loss_max_clamp": None}
    out = distillation_loss(cfg, teacher_topk_ids=ids, teacher_topk_logprobs=lps.float(), student_logits=student)
    raw = topk_kl(ids, lps.float(), student_logits=student, log_prob_min_clamp=-10.0)
    assert (raw < 0).any()  # the case exercises the floor
    assert torch.equal(out.per_token_loss, raw.clamp_min(0.0))


def test_topk_mode_reports_student_and_teacher_mass():
    case = make_case(n=8, h=8, v=30, seed=42)
    ids, lps = topk_of(case.teacher_logits64, 4)
    out = distillation_loss(
        {"loss_mode": "forward_kl_topk", "use_policy_gradient": False, "topk": 4},
        teacher_topk_ids=ids, teacher_topk_logprobs=lps.float(), student_logits=case.student_logits,
    )
    assert 0 < out.metrics["student_mass"] < 1
    assert out.metrics["teacher_mass"] == pytest.approx(lps.exp().sum(-1).mean().item(), rel=1e-5)


def test_nitrobrew_is_full_vocabulary_forward_kl_with_kd_temperature_and_clamp():
    case = make_case(n=12, h=8, v=40, seed=43)
    cfg = {"loss_mode": "nitrobrew", "use_policy_gradient": False, "kd_temperature": 2.0,
           "log_prob_min_clamp": -4.0, "loss_max_clamp": None}
    out = distillation_loss(cfg, teacher_hidden=case.teacher_hidden, teacher_weight=case.teacher_weight,
                            student_hidden=case.student_hidden, student_weight=case.student_weight)
    ref = full_vocab_ref(case.student_logits64, case.teacher_logits64, temperature=2.0, clamp=-4.0)
    assert rel_err(out.per_token_loss, ref) <= 1e-5


def test_nitrobrew_reverse_kl_ignores_the_forward_only_clamp():
    case = make_case(n=12, h=8, v=40, seed=44)
    cfg = {"loss_mode": "nitrobrew_reverse_kl", "use_policy_gradient": False, "loss_max_clamp": None}
    out = distillation_loss(cfg, teacher_hidden=case.teacher_hidden, teacher_weight=case.teacher_weight,
                            student_logits=case.student_logits)
    ref = full_vocab_kl(case.teacher_hidden, case.teacher_weight, student_logits=case.student_logits,
                        direction="reverse")
    # Supervised use takes the reduced path, whose per-token values agree to float32 rounding.
    assert rel_err(out.per_token_loss, ref) <= 1e-6


@pytest.mark.parametrize("mode,direction", [("topk_reverse_kl", "reverse"), ("topk_jsd", "jsd")])
def test_proctor_topk_modes_use_the_renormalised_divergences(mode, direction):
    case = make_case(n=10, h=8, v=30, seed=45)
    ids, lps = topk_of(case.teacher_logits64, 5)
    cfg = {"loss_mode": mode, "use_policy_gradient": False, "jsd_beta": 0.3, "loss_max_clamp": None}
    out = distillation_loss(cfg, teacher_topk_ids=ids, teacher_topk_logprobs=lps.float(),
                            student_logits=case.student_logits)
    ref = topk_kl(ids, lps.float(), student_logits=case.student_logits, direction=direction, beta=0.3)
    assert torch.equal(out.per_token_loss, ref)


def test_missing_inputs_for_the_mode_raise_naming_them():
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        distillation_loss({"loss_mode": "forward_kl_topk", "use_policy_gradient": False},
                          student_logits=torch.zeros(2, 5))


def test_defaults_are_verls_yaml_defaults_as_the_server_assumes():
    from proctor.client.loss import LossSettings

    defaults = LossSettings.from_config({})
    assert (defaults.loss_mode, defaults.topk, defaults.use_policy_gradient) == ("k3", 32, False)
    assert defaults.loss_max_clamp is None and defaults.log_prob_min_clamp is None
