"""The distillation loss modes by family, known to both sides.

The client's loss library implements them; the server reads a verl `distillation_loss`
block and must know what a mode needs served (top-k, or hidden states and the
unembedding). Neither side may import the other, so the names live here.
"""

from __future__ import annotations

SAMPLED_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES = ("forward_kl_topk", "topk_reverse_kl", "topk_jsd")
HIDDEN_STATE_MODES = ("nitrobrew", "nitrobrew_reverse_kl", "full_jsd")
LOSS_MODES = SAMPLED_MODES + TOPK_MODES + HIDDEN_STATE_MODES

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
