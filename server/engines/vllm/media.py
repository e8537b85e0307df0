"""Prompts with media for the vLLM-family engines: collapse, let vLLM expand, check the expansion.

vLLM's multimodal processors expand the placeholders of a *token* prompt themselves (each
`<|image_pad|>` becomes the image's N tokens), so the rollout's already expanded ids would come
back longer and every row after the first item would be misaligned. The engine therefore sends
each placeholder run cut to one token (`multimodal.collapse_runs`), and checks that vLLM's
expansion reproduces the sent ids exactly, item by item (`multimodal.check_runs`), before
anything is scored: the vLLM engine renders the prompt first (`renderer.render_cmpl_async`, the
processing `generate` would do anyway, done once) and submits the rendered input; the
vLLM-Omni engine, whose orchestrator renders inside the stage, checks the prompt ids the stage
reports before a row is read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from proctor.server.engines.base import EngineRequest, RequestRejected
from proctor.server.engines.multimodal import (
    Placeholders,
    check_counts,
    check_runs,
    collapse_runs,
    decoded_media,
    run_lengths,
)


class VllmMedia:
    """One teacher's placeholder rule for vLLM prompts."""

    def __init__(self, model_path: str) -> None:
        self.placeholders = Placeholders.of_model(model_path)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.placeholders.kinds

    def token_prompt(self, request: EngineRequest) -> dict[str, Any]:
        """The TokensPrompt (a dict) for a request: its ids, or for one with media the collapsed
        ids, the media as the service decoded them and the rollout's processor kwargs."""
        salt = {"cache_salt": request.cache_salt} if request.cache_salt else {}
        if not request.media:
            return {"prompt_token_ids": request.token_ids.tolist(), **salt}
        problem = check_counts(request, self.placeholders)
        if problem is not None:
            raise problem
        prompt: dict[str, Any] = {
            "prompt_token_ids": collapse_runs(request.token_ids, self.placeholders),
            "multi_modal_data": decoded_media(request),
            **salt,
        }
        if request.media.processor_kwargs:
            prompt["mm_processor_kwargs"] = dict(request.media.processor_kwargs)
        return prompt

    def check_expansion(self, request: EngineRequest, expanded: list[int] | None) -> None:
        """Raise the request's error unless vLLM's expanded prompt is the sent ids exactly."""
        if not request.media:
            return
        if expanded is None:
            raise RequestRejected("token_ids", "the engine reported no prompt ids to check the placeholders against")
        kinds = request.media.kinds()
        problem = check_runs(request, self.placeholders, run_lengths(expanded, self.placeholders, kinds))
        if problem is None and not np.array_equal(np.asarray(expanded), request.token_ids):
            problem = RequestRejected(
                "token_ids", f"the model's processor expands the media to {len(expanded)} tokens, "
                f"not the {request.num_tokens} sent",
            )
        if problem is not None:
            raise problem

    async def rendered(self, engine: Any, request: EngineRequest) -> dict[str, Any]:
        """What `engine.generate` / `engine.encode` take: for media, vLLM's rendered input (its
        processor ran once, here), checked against the sent ids."""
        prompt = self.token_prompt(request)
        if not request.media:
            return prompt
        from proctor.server.engines.vllm.adapter import render_tokens_prompt

        engine_input = await render_tokens_prompt(engine, prompt)
        self.check_expansion(request, list(engine_input["prompt_token_ids"]))
        return engine_input
