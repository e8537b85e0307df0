"""What one scoring request hands `AsyncOmni.generate`: the TokensPrompt and the SamplingParams.

Scoring is the vLLM engine's: one prompt per sequence, `SamplingParams(max_tokens=1,
prompt_logprobs=K, detokenize=False)`, with `multi_modal_data` as the service decoded it
(`MultiModalInputs.decoded`) and `mm_processor_kwargs` exactly as the rollout sent them; the
token ids must already hold the expanded placeholders (what the rollout's processor produced and
vLLM generated from), and a result whose length differs is refused rather than misaligned
(`outputs.read_result`).

Kept apart from the engine class so that the request's shape can be read and tested without a
running vLLM-Omni: these are pure functions of the request.
"""

from __future__ import annotations

from typing import Any

from proctor.server.engines.base import EngineRequest
from proctor.server.engines.multimodal import decoded_media
from proctor.server.engines.vllm.args import scoring_sampling_kwargs
from proctor.server.engines.vllm.media import VllmMedia


def build_prompt(request: EngineRequest, media_rule: VllmMedia | None = None) -> dict[str, Any]:
    """The TokensPrompt (a dict) for one request: ids, media as the service decoded it, processor
    kwargs as sent. With the model's placeholder rule (`vllm_media`; a checkpoint whose config
    names its placeholder tokens) each placeholder run is collapsed for the stage's processor to
    expand again; without one the ids go as sent and only their length is checked afterwards."""
    if media_rule is not None and media_rule.kinds:
        return media_rule.token_prompt(request)
    prompt: dict[str, Any] = {"prompt_token_ids": request.token_ids.tolist()}
    media = request.media
    if media:
        prompt["multi_modal_data"] = decoded_media(request)
        if media.processor_kwargs:
            prompt["mm_processor_kwargs"] = dict(media.processor_kwargs)
    return prompt


def sampling_params(topk: int) -> Any:
    """vLLM's SamplingParams for scoring with top-k `topk` (vLLM imported only when a request is
    built, so that this module loads where vLLM is not installed)."""
    from vllm import SamplingParams

    return SamplingParams(**scoring_sampling_kwargs(topk))
