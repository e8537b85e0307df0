"""A finished vLLM-Omni request's output read into proctor's answer: the RequestOutput inside
the OmniRequestOutput, its prompt log-probs as rows, the Thinker's hidden states, score_ids.

Hidden states: vLLM-Omni's AR model runner (`GPUARModelRunner` / `NPUARModelRunner`) attaches
to every scheduled chunk a payload `{"hidden": <last-layer activations of the chunk's tokens>}`
for a final stage whose model declares it a client output (`adapter.register_plugin`); the output
processor accumulates the chunks under the stage's `engine_output_type` ("latent" in the
thinker-only topologies) into the completion's `multimodal_output`. Those are the Thinker's text hidden states after its final norm, what its
`lm_head` consumes, so one engine serves log-probs and hidden states together; they are read
only for requests that ask for them. The cost is the runner's device→host copy of [T, H] per
request, paid whether or not the request wanted hidden states.

score_ids come from those hidden states and the Thinker's lm_head rows (`score_ids`), since the
stage has no fixed-token scoring of its own.

Kept apart from the engine class: everything here is a pure function of one output, so it can be
checked against fake outputs without a stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from proctor.server.engines.base import EngineError, EngineRequest, EngineResult, RequestRejected
from proctor.server.engines.score_ids import scores_from_hidden
from proctor.server.engines.token_ids import index_tensor
from proctor.server.engines.vllm.media import VllmMedia
from proctor.server.engines.vllm_omni.prompt_logprobs import extract_rows, hidden_rows

# Keys of the accumulated multimodal_output that hold the Thinker's hidden states, in order.
HIDDEN_KEYS = ("hidden", "latent", "latents", "model_outputs")


def stage_output(output: Any) -> Any:
    """The vLLM RequestOutput inside an OmniRequestOutput (or the output itself)."""
    inner = getattr(output, "request_output", None)
    return inner if inner is not None else output


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return torch.cat([v.reshape(-1, v.shape[-1]) for v in value], dim=0)
    return None


def extract_hidden(request_output: Any, total: int) -> torch.Tensor:
    """The Thinker's per-position hidden states [T, H] from a finished request's multimodal output.

    vLLM-Omni attaches the accumulated payload to the RequestOutput (`multimodal_output`) and to
    its completion (`outputs[0].multimodal_output`); a chunked prefill leaves a list of chunks.
    """
    holders = [request_output, *list(getattr(request_output, "outputs", None) or [])[:1]]
    for holder in holders:
        payload = getattr(holder, "multimodal_output", None)
        if not isinstance(payload, Mapping):
            continue
        for key in HIDDEN_KEYS:
            states = _as_tensor(payload.get(key))
            if states is not None:
                if states.dim() != 2 or states.shape[0] < total:
                    raise EngineError(
                        f"vLLM-Omni returned hidden states of shape {tuple(states.shape)} for {total} tokens"
                    )
                return states[:total]  # a decode step, if any ran, is not part of the prompt
    raise EngineError(
        "vLLM-Omni returned no hidden states: the Thinker must declare them a client output "
        "(proctor's vllm_omni.general_plugins entry point, installed with proctor in vLLM-Omni's "
        f"environment; looked for {', '.join(HIDDEN_KEYS)} in multimodal_output)"
    )


def _expansion_problem(request: EngineRequest, out: Any, media: VllmMedia) -> RequestRejected | None:
    """Why the stage's prompt is not the ids the request sent, if it is not: the stage's
    processor expands media placeholders itself, and a different length would misalign rows."""
    if request.media and media.kinds:  # the stage's expansion must be the ids sent
        try:
            media.check_expansion(request, getattr(out, "prompt_token_ids", None))
        except RequestRejected as problem:
            return problem
        return None
    positions = getattr(out, "prompt_logprobs", None)
    if request.media and positions is not None and len(positions) != request.num_tokens:
        return RequestRejected(
            "token_ids",
            f"the processor expanded the prompt to {len(positions)} tokens from {request.num_tokens}: "
            "send the token ids with the media placeholders already expanded",
            request_id=request.request_id,
        )
    return None


def read_result(
    request: EngineRequest, final: Any, media: VllmMedia, dtype: torch.dtype
) -> EngineResult | RequestRejected:
    """The request's answer from its final output: rows for what it asked, hidden states in
    `dtype` on the CPU. An aborted request raises CancelledError (0.30.0 ends an aborted
    request with an output of finish_reason "abort" instead of raising)."""
    if final is None:
        raise EngineError("vLLM-Omni returned no output")
    out = stage_output(final)
    completions = list(getattr(out, "outputs", None) or [])
    if completions and getattr(completions[0], "finish_reason", None) == "abort":
        raise asyncio.CancelledError  # 0.30.0's terminal abort output: an aborted request
    problem = _expansion_problem(request, out, media)
    if problem is not None:
        return problem
    result = EngineResult(first_row=request.first_row)
    if request.logprobs or request.topk:
        result.logprobs, result.topk_ids, result.topk_logprobs = extract_rows(
            getattr(out, "prompt_logprobs", None), request.token_ids, request.first_row, request.topk,
            logprobs=request.logprobs,
        )
    if request.hidden_states:
        states = extract_hidden(out, request.num_tokens)
        rows = hidden_rows(states, request.num_tokens, request.first_row)
        result.hidden_states = rows.to(device="cpu", dtype=dtype).contiguous()
    return result


def score_ids_from_hidden(request: EngineRequest, final: Any, unembedding: torch.Tensor) -> torch.Tensor:
    """score_ids from the AR stage's hidden states (its latent output, which every request
    carries here) and the Thinker's lm_head rows, normalised by the actual token's log-prob:
    the stage has no fixed-token scoring of its own (`score_ids.scores_from_hidden`)."""
    out = stage_output(final)
    actual, _, _ = extract_rows(out.prompt_logprobs, request.token_ids, request.first_row, request.topk)
    states = hidden_rows(extract_hidden(out, request.num_tokens), request.num_tokens, request.first_row)
    return scores_from_hidden(states, unembedding, index_tensor(request.score_ids),
                              index_tensor(request.token_ids[request.first_row :]), actual)
