"""Routers whose replicas are real torch engines behind a delay, for tests that need a busy teacher.

The delay stands in for a large model's forward pass; the scores still come from the real
engine, and `InjectedEngine.scored_ids` proves which requests cost compute.
"""

from __future__ import annotations

from proctor.server.chaos import InjectedEngine
from proctor.server.engines import EngineSpec, TeacherEngine, create_engine
from proctor.server.routing import Replica, Router, Teacher


def slow_router(model_dir, delay_s: float, *, name: str = "tiny", replicas: int = 1) -> tuple[Router, list[InjectedEngine]]:
    """A one-teacher router whose replicas wait delay_s per batch (the list fills as they start)."""
    engines: list[InjectedEngine] = []

    async def build() -> TeacherEngine:
        spec = EngineSpec(name="torch", model_path=str(model_dir), max_topk=64)
        engine = InjectedEngine(create_engine(spec), delay_per_batch_s=delay_s)
        engines.append(engine)
        return engine

    teacher = Teacher(name, [Replica(f"{name}-{i}", build) for i in range(replicas)])
    return Router([teacher]), engines
