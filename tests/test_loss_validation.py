"""Bad arguments fail early with a ValueError that names the argument."""

from __future__ import annotations

import pytest
import torch

from proctor.client.loss import aggregate, distillation_loss, full_vocab_kl, sampled_kl, topk_kl

N, H, V, K = 6, 8, 20, 3


@pytest.fixture
def t():
    g = torch.Generator().manual_seed(0)
    return {
        "th": torch.randn(N, H, generator=g),
        "tw": torch.randn(V, H, generator=g),
        "sh": torch.randn(N, H, generator=g),
        "sw": torch.randn(V, H, generator=g),
        "logits": torch.randn(N, V, generator=g),
        "ids": torch.randint(0, V, (N, K), generator=g),
        "lps": -torch.rand(N, K, generator=g) * 3,
    }


def test_full_vocab_with_both_student_forms_raises(t):
    with pytest.raises(ValueError, match="student_logits"):
        full_vocab_kl(t["th"], t["tw"], student_hidden=t["sh"], student_weight=t["sw"], student_logits=t["logits"])


def test_full_vocab_with_no_student_raises(t):
    with pytest.raises(ValueError, match="student"):
        full_vocab_kl(t["th"], t["tw"])


def test_student_hidden_without_weight_raises(t):
    with pytest.raises(ValueError, match="student_weight"):
        full_vocab_kl(t["th"], t["tw"], student_hidden=t["sh"])


def test_student_hidden_size_mismatch_raises(t):
    with pytest.raises(ValueError, match="student_weight"):
        full_vocab_kl(t["th"], t["tw"], student_hidden=t["sh"], student_weight=t["sw"][:, :5])


def test_token_count_mismatch_raises(t):
    with pytest.raises(ValueError, match="student_hidden"):
        full_vocab_kl(t["th"], t["tw"], student_hidden=t["sh"][:4], student_weight=t["sw"])


def test_teacher_vocabulary_mismatch_raises(t):
    with pytest.raises(ValueError, match="teacher_weight"):
        full_vocab_kl(t["th"], t["tw"][:10], student_logits=t["logits"])


def test_teacher_hidden_size_mismatch_raises(t):
    with pytest.raises(ValueError, match="teacher_"):
        full_vocab_kl(t["th"][:, :4], t["tw"], student_logits=t["logits"])


def test_unknown_direction_raises(t):
    with pytest.raises(ValueError, match="direction"):
        full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], direction="backward")


def test_beta_outside_unit_interval_raises(t):
    with pytest.raises(ValueError, match="beta"):
        full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], direction="jsd", beta=1.5)


def test_clamp_with_reverse_direction_raises(t):
    with pytest.raises(ValueError, match="log_prob_min_clamp"):
        full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], direction="reverse", log_prob_min_clamp=-5.0)


def test_non_positive_temperature_raises(t):
    with pytest.raises(ValueError, match="temperature"):
        full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], temperature=0.0)


def test_bad_chunk_size_raises(t):
    with pytest.raises(ValueError, match="chunk_vocab"):
        full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], chunk_vocab=0)


def test_topk_ids_out_of_range_raise(t):
    bad = t["ids"].clone()
    bad[0, 0] = V
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        topk_kl(bad, t["lps"], student_logits=t["logits"])


def test_negative_topk_ids_raise(t):
    bad = t["ids"].clone()
    bad[2, 1] = -1
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        topk_kl(bad, t["lps"], student_logits=t["logits"])


def test_topk_shape_mismatch_raises(t):
    with pytest.raises(ValueError, match="teacher_topk_logprobs"):
        topk_kl(t["ids"], t["lps"][:, :2], student_logits=t["logits"])


def test_topk_float_ids_raise(t):
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        topk_kl(t["ids"].float(), t["lps"], student_logits=t["logits"])


def test_topk_with_both_student_forms_raises(t):
    with pytest.raises(ValueError, match="student_logits"):
        topk_kl(t["ids"], t["lps"], student_hidden=t["sh"], student_weight=t["sw"], student_logits=t["logits"])


def test_topk_with_no_student_raises(t):
    with pytest.raises(ValueError, match="student"):
        topk_kl(t["ids"], t["lps"])


def test_sampled_unknown_mode_raises():
    with pytest.raises(ValueError, match="mode"):
        sampled_kl(torch.zeros(3), torch.zeros(3), "k4")


def test_sampled_shape_mismatch_raises():
    with pytest.raises(ValueError, match="teacher_logprobs"):
        sampled_kl(torch.zeros(3), torch.zeros(4), "k3")


@pytest.mark.parametrize(
    ("call", "function"),
    [
        (lambda t: full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], chunk_vocabs=4), "full_vocab_kl"),
        (lambda t: topk_kl(t["ids"], t["lps"], student_logits=t["logits"], teacher_index=None), "topk_kl"),
        (lambda t: aggregate(torch.ones(N), dp_sizes=2), "aggregate_weights"),
        (lambda t: distillation_loss({"loss_mode": "k3"}, student_logprob=torch.zeros(N)), "distillation_loss"),
    ],
)
def test_an_option_the_function_does_not_take_is_a_type_error(t, call, function):
    # The shared options are read from one TypedDict per function: a misspelt or foreign one
    # (topk_kl has no teacher_index) must fail as a plain keyword argument would.
    with pytest.raises(TypeError, match=rf"{function}\(\) got unexpected keyword argument"):
        call(t)


def test_option_defaults_are_the_documented_ones(t):
    # beta defaults to 0.5 for the JSD: the default written once in LossOptions.
    explicit = full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], direction="jsd", beta=0.5)
    implicit = full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], direction="jsd")
    other = full_vocab_kl(t["th"], t["tw"], student_logits=t["logits"], direction="jsd", beta=0.25)
    assert torch.equal(explicit, implicit)
    assert not torch.allclose(explicit, other)
