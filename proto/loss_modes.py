"""The `distillation_loss` schema, known to both sides: its modes by family, and every key the
block may hold with its default.

The client's loss library implements the modes and reads every setting; the server reads the
block only to know what a mode needs served (top-k, or hidden states and the unembedding) and
must accept the rest unchanged. Neither side may import the other, so the schema lives here,
torch-free, and both read it.
"""

from __future__ import annotations

from collections.abc import Callable

SAMPLED_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES = ("forward_kl_topk", "topk_reverse_kl", "topk_jsd")
HIDDEN_STATE_MODES = ("nitrobrew", "nitrobrew_reverse_kl", "full_jsd")
# Losses on the student's top-k support: the trainer sends the ids (score_ids), the server must
# serve the teacher's log-probs at them (score_logprobs).
STUDENT_TOPK_MODES = ("student_topk_reverse_kl",)
LOSS_MODES = SAMPLED_MODES + TOPK_MODES + HIDDEN_STATE_MODES + STUDENT_TOPK_MODES

# verl's `distillation.yaml` defaults for the loss block (what a verl run actually gets; its
# dataclass defaults differ). The client's loss settings and the server's config both read
# these, so a partial config means the same thing on both sides of the wire.
VERL_LOSS_DEFAULTS = {
    "loss_mode": "k3",
    "topk": 32,
    "use_task_rewards": True,
    "distillation_loss_coef": 1.0,
    "loss_max_clamp": None,
    "log_prob_min_clamp": None,
    "use_policy_gradient": False,
    "policy_loss_mode": "vanilla",
}

# Every setting either side reads, with its default: verl's (above), verl-omni's, proctor's.
LOSS_SETTINGS = {
    **VERL_LOSS_DEFAULTS,
    "kd_temperature": 1.0,  # verl-omni
    "jsd_beta": 0.5,  # proctor: the generalised JSD's mixture weight
    "student_topk_form": "exact",  # proctor: student_topk_reverse_kl as "exact" or "renormalised"
    "loss_agg_mode": "token-mean",  # proctor: verl's loss_agg_mode names
    "chunk_tokens": None,  # proctor: full-vocabulary chunking
    "chunk_vocab": None,
    "pg_ratio": None,  # LoongSage-style mixing
    "gkd_ratio": None,
}
# verl keys of the block that configure its PPO machinery or runtime, not the per-token loss:
# accepted by both sides and read by neither.
VERL_IGNORED_LOSS_KEYS = frozenset(
    {"_target_", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "global_batch_info", "loss_settings",
     "use_chunked_topk", "chunked_topk_chunk_size", "use_policy_loss"}
)


def is_topk(mode: str) -> bool:
    """The mode needs the teacher's top-k ids and log-probs."""
    return mode in TOPK_MODES


def is_hidden_state(mode: str) -> bool:
    """The mode needs the teacher's hidden states and unembedding (full vocabulary)."""
    return mode in HIDDEN_STATE_MODES


def is_student_topk(mode: str) -> bool:
    """The mode needs the teacher's log-probs at the student's top-k ids (the server serves score_ids)."""
    return mode in STUDENT_TOPK_MODES


def is_sampled(mode: str) -> bool:
    """The mode needs only the teacher's log-probs of the sampled tokens."""
    return mode in SAMPLED_MODES


def _family(test: Callable[[str], bool], doc: str) -> property:
    return property(lambda self: test(self.loss_mode), doc=doc)


class LossFamilies:
    """The families of a settings object's `loss_mode`, under one name on both sides."""

    loss_mode: str

    is_topk = _family(is_topk, "The loss reads the teacher's top-k.")
    is_hidden_state = _family(is_hidden_state, "The loss reads the teacher's hidden states.")
    is_sampled = _family(is_sampled, "The loss reads the sampled tokens' log-probs.")
    is_student_topk = _family(is_student_topk, "The loss reads the teacher at the student's top-k.")
