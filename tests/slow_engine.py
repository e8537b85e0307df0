"""A real torch engine behind a configurable delay, for tests that need a busy teacher.

The delay stands in for a large model's forward pass; the scores themselves still come from
the real engine. It records which requests it scored, so a test can prove that a cancelled
or expired request cost no compute.
"""

from __future__ import annotations

import asyncio

from proctor.server.engines import EngineSpec, TeacherEngine, create_engine
from proctor.server.engines.base import EngineInfo, EngineRequest, EngineResult
from proctor.server.routing import Replica, Router, Teacher


class DelayedEngine(TeacherEngine):
    def __init__(self, inner: TeacherEngine, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.scored_ids: list[str] = []
        self.batches = 0

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def describe(self) -> EngineInfo:
        return self.inner.describe()

    def unembedding(self):
        return self.inner.unembedding()

    def token_budget(self) -> int:
        return self.inner.token_budget()

    async def score(self, batch: list[EngineRequest]) -> list[EngineResult]:
        self.batches += 1
        await asyncio.sleep(self.delay_s)
        results = await self.inner.score(batch)
        self.scored_ids.extend(r.request_id for r in batch)
        return results


def slow_router(model_dir, delay_s: float, *, name: str = "tiny", replicas: int = 1) -> tuple[Router, list[DelayedEngine]]:
    """A one-teacher router whose replicas are delayed torch engines (the list fills as they start)."""
    engines: list[DelayedEngine] = []

    async def build() -> TeacherEngine:
        engine = DelayedEngine(create_engine(EngineSpec(name="torch", model_path=str(model_dir))), delay_s)
        engines.append(engine)
        return engine

    teacher = Teacher(name, [Replica(f"{name}-{i}", build) for i in range(replicas)])
    return Router([teacher]), engines
