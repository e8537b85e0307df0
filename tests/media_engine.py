"""A teacher engine that takes media, for the service's media path on a machine without one.

The engines that take media for real (vLLM-Omni's Thinker; the multimodal vLLM and torch
paths of a later issue) cannot run here yet, so this wraps the real torch engine: it declares
images, videos and audios, records the decoded media each request brought (what the service
decoded before admission: the engine never sees bytes) and scores the text tokens with the
wrapped engine, so answers stay exact.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from proctor.server.engines import create_engine
from proctor.server.engines.base import EngineInfo, EngineRequest, EngineSpec, Outcome, TeacherEngine


class MediaTakingEngine(TeacherEngine):
    def __init__(self, spec: EngineSpec) -> None:
        self.inner = create_engine(spec)
        self.received: list[dict[str, Any] | None] = []  # decoded media per scored request

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def describe(self) -> EngineInfo:
        return replace(self.inner.describe(), media=("images", "videos", "audios"))

    def token_budget(self) -> int:
        return self.inner.token_budget()

    def unembedding(self) -> torch.Tensor:
        return self.inner.unembedding()

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        self.received.extend(r.media.decoded if r.media else None for r in batch)
        return await self.inner.score([replace(r, media=None) for r in batch])
