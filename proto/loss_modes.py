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
