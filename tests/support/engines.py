"""Engines for tests and benchmarks: the real torch engine behind a switch, never a fake score.

`InjectedEngine` wraps a real `TeacherEngine`: it can be made slower (a per-token delay,
as a slower device would be, or a per-batch one, as a larger teacher would be), killed (every
later call fails and its health check says so: a crashed replica) or frozen (calls never
return and the health check fails: a wedged device or a hung actor), which is what failing
replicas look like to the router. `MediaTakingEngine` declares images, videos and audios, so
the service's media path runs on a machine without a multimodal engine. Scores still come
from the wrapped engine, so answers can be checked exactly while replicas fail under them.
This is test support: it does not ship in the server package.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import torch

from proctor.server.engines.base import (
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineResult,
    EngineSpec,
    Outcome,
    TeacherEngine,
)
from proctor.server.engines.factory import create_engine


class InjectedEngine(TeacherEngine):
    """A real engine plus a kill switch and an optional per-token delay."""

    def __init__(
        self,
        inner: TeacherEngine,
        *,
        delay_per_token_s: float = 0.0,
        delay_per_batch_s: float = 0.0,
        token_budget: int | None = None,
    ) -> None:
        self.inner = inner
        self.delay_per_token_s = delay_per_token_s
        self.delay_per_batch_s = delay_per_batch_s
        self._token_budget = token_budget
        self.batches_started = 0
        self.scored_ids: list[str] = []  # requests whose batch completed: proof of what cost compute
        self.dead = False
        self.frozen = False
        self.batches = 0
        self.requests = 0

    def kill(self) -> None:
        """From now on every batch fails (including one in progress) and health checks fail."""
        self.dead = True

    def freeze(self) -> None:
        """From now on no batch returns (including one in progress) and health checks fail."""
        self.frozen = True

    async def _hang_if_frozen(self) -> None:
        if self.frozen:
            await asyncio.Event().wait()  # until cancelled

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def describe(self) -> EngineInfo:
        return self.inner.describe()

    def token_budget(self) -> int:
        return self._token_budget or self.inner.token_budget()

    @property
    def forward_passes(self) -> int:
        return getattr(self.inner, "forward_passes", self.batches)

    def unembedding(self) -> torch.Tensor:
        return self.inner.unembedding()

    async def check_health(self) -> bool:
        return not (self.dead or self.frozen) and await self.inner.check_health()

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        if self.dead:
            raise EngineError("injected failure: replica is dead")
        await self._hang_if_frozen()
        self.batches_started += 1
        delay = self.delay_per_batch_s + self.delay_per_token_s * sum(r.num_tokens for r in batch)
        if delay:
            await asyncio.sleep(delay)
        results = await self.inner.score(batch)
        await self._hang_if_frozen()
        if self.dead:  # killed while the batch ran: its results are lost with it
            raise EngineError("injected failure: replica died mid-batch")
        self.batches += 1
        self.requests += len(batch)
        self.scored_ids.extend(r.request_id for r, o in zip(batch, results, strict=True) if isinstance(o, EngineResult))
        return results

    async def abort(self, request_keys: list[str]) -> None:
        await self.inner.abort(request_keys)


class MediaTakingEngine(InjectedEngine):
    """The real torch engine declaring images, videos and audios.

    The engines that take media for real (vLLM-Omni's Thinker, the multimodal vLLM and torch
    paths) cannot run on every machine, so this records the decoded media each request brought
    (what the service decoded before admission: the engine never sees bytes) and scores the
    text tokens with the wrapped engine, so answers stay exact.
    """

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(create_engine(spec))
        self.received: list[dict[str, Any] | None] = []  # decoded media per scored request

    def describe(self) -> EngineInfo:
        return replace(self.inner.describe(), media=("images", "videos", "audios"))

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        self.received.extend(r.media.decoded if r.media else None for r in batch)
        return await super().score([replace(r, media=None) for r in batch])
