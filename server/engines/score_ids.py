"""score_ids on vLLM-Omni's AR stage: the teacher's full-vocabulary log-probs at ids the caller chose.

(The vLLM engine scores them on the device, in its scoring pooler; vLLM-Omni's AR stage runs
vLLM's generation runner, so there they come from the stage's outputs.) ListTeachers names the
method (`TeacherInfo.score_ids_method` = `hidden_states`):

* `hidden_states`: from the Thinker's last-layer post-norm hidden states (the AR stage's latent
  output) and its `lm_head` rows:
  `log p(id) = h·W[id] - lse(h·Wᵀ)`. The full-vocabulary normaliser comes from the actual token,
  whose log-prob vLLM already returns: `lse = h·W[actual] - log p(actual)`. So a row costs K + 1
  dot products of length H and no `[T, V]` product exists. Its error is vLLM's own rounding of
  `log p(actual)` (the dot products run in float64). It holds only where logits = h·Wᵀ: a model
  with a soft-cap or a logit scale (`logit_transforms`) is refused at start, and a head bias
  cannot exist there (the checkpoint's `lm_head` is read as a weight alone).
"""

from __future__ import annotations

import torch

from proctor.server.engines.base import EngineError

FROM_HIDDEN = "hidden_states"
# Elements of the gathered [rows, K, H] lm_head rows held at once (32 MiB in float64).
_GATHER_ELEMENTS = 1 << 22


def scores_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    score_ids: torch.Tensor,
    actual_ids: torch.Tensor,
    actual_logprobs: torch.Tensor,
) -> torch.Tensor:
    """float32 [R, K] log-probs at `score_ids` (-1: padding, -inf out) from the rows' hidden
    states [R, H], the unembedding [V, H] and the actual tokens' ids and log-probs [R].

    Normalised by the actual token: lse = h·W[actual] - log p(actual), so only K + 1 dot
    products a row are formed, in row blocks that keep the gathered [rows, K, H] weight rows small.
    They run in float64: next to the teacher's forward pass (≈ 2·params flops a token) K + 1 dot
    products are nothing, and then the only rounding left is the engine's own in log p(actual).
    """
    rows, k = score_ids.shape
    if hidden.shape[0] != rows or actual_ids.shape[0] != rows or actual_logprobs.shape[0] != rows:
        raise EngineError(f"score_ids rows {rows} do not match hidden states {tuple(hidden.shape)} "
                          f"and {actual_logprobs.shape[0]} log-probs")
    out = torch.empty((rows, k), dtype=torch.float32)
    ids = score_ids.to(torch.long)
    step = max(1, _GATHER_ELEMENTS // max(1, (k + 1) * hidden.shape[1]))
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        h = hidden[lo:hi].to(torch.float64)
        cols = torch.cat([actual_ids[lo:hi, None].to(torch.long), ids[lo:hi].clamp_min(0)], dim=1)
        logits = torch.bmm(weight[cols].to(torch.float64), h.unsqueeze(2)).squeeze(2)  # [rows, K + 1]
        lse = logits[:, 0] - actual_logprobs[lo:hi].to(torch.float64)
        out[lo:hi] = logits[:, 1:] - lse[:, None]
    return out.masked_fill_(ids < 0, float("-inf"))
