"""Routers whose replicas are real torch engines, shaped for what a suite needs: a busy teacher,
two teachers behind routing keys, or replicas that can be killed, frozen and slowed.

The delays stand in for a large model's forward pass or a slower device; the scores still come
from the real engine, and `InjectedEngine.scored_ids` proves which requests cost compute.
"""

from __future__ import annotations

from pathlib import Path

from proctor.server.engines.base import EngineSpec, TeacherEngine
from proctor.server.engines.factory import create_engine
from proctor.server.front.fleet.routing import Replica, ReplicaSet, RestartPolicy, Router
from proctor.server.front.runtime import ServerThread

from support.engines import InjectedEngine
from support.servers import start_server


def slow_router(
    model_dir: Path | str, delay_s: float, *, name: str = "tiny", replicas: int = 1
) -> tuple[Router, list[InjectedEngine]]:
    """A one-teacher router whose replicas wait delay_s per batch (the list fills as they start)."""
    engines: list[InjectedEngine] = []

    async def build() -> TeacherEngine:
        spec = EngineSpec(name="torch", model_path=str(model_dir), max_topk=64)
        engine = InjectedEngine(create_engine(spec), delay_per_batch_s=delay_s)
        engines.append(engine)
        return engine

    teacher = ReplicaSet(name, [Replica(f"{name}-{i}", build) for i in range(replicas)], tokenizer_path=str(model_dir))
    return Router([teacher]), engines


def two_teacher_router(math_dir: Path, geo_dir: Path) -> Router:
    """math (routing key openai/gsm8k) and geo (key hiyouga/geometry3k), one torch replica each."""

    def teacher(name: str, path: Path, key: str) -> ReplicaSet:
        spec = EngineSpec(name="torch", model_path=str(path))

        async def build() -> TeacherEngine:
            return create_engine(spec)

        return ReplicaSet(name, [Replica(f"{name}-0", build)], keys=(key,), tokenizer_path=str(path))

    return Router([teacher("math", math_dir, "openai/gsm8k"), teacher("geo", geo_dir, "hiyouga/geometry3k")])


class InjectedReplicas:
    """A teacher whose replicas are real torch engines wrapped in `InjectedEngine`.

    `engines[i]` is replica i's current engine (a restart builds a new one); `fail_restarts`
    makes restarts fail until cleared.
    """

    def __init__(self, model_dir: Path | str, *, delays: list[float], policy: str = "least_outstanding",
                 health_check_interval_s: float | None = None) -> None:
        self.engines: list[InjectedEngine | None] = [None] * len(delays)
        self.built = [0] * len(delays)
        self.fail_restarts = False
        spec = EngineSpec("torch", str(model_dir), dtype="float32")

        def factory(i: int):
            async def build() -> TeacherEngine:
                if self.fail_restarts and self.built[i]:
                    raise RuntimeError("injected: replica cannot come back yet")
                self.built[i] += 1
                self.engines[i] = InjectedEngine(create_engine(spec), delay_per_token_s=delays[i])
                return self.engines[i]

            return build

        self.replicas = [Replica(f"r{i}", factory(i)) for i in range(len(delays))]
        self.teacher = ReplicaSet("t", self.replicas, policy=policy, health_check_interval_s=health_check_interval_s,
                               restart=RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2))
        self.router = Router([self.teacher])

    def serve(self) -> ServerThread:
        return start_server(self.router)


def replica_router(name: str, specs: list[EngineSpec], **teacher) -> Router:
    """One teacher whose replica i is `specs[i]`'s engine in a replica worker of its own (so replicas
    may differ: one with perturbed weights, say); `teacher`: further ReplicaSet settings."""
    from functools import partial

    from proctor.server.front.fleet.routing import engine_replica
    from proctor.server.worker.replica_engine import create_replica_engine

    replicas = [engine_replica(f"{name}-{i}", partial(create_replica_engine, spec, name=f"{name}-{i}"))
                for i, spec in enumerate(specs)]
    return Router([ReplicaSet(name, replicas, tokenizer_path=specs[0].model_path, **teacher)])


def reuse_router(model_dir: Path, *, replicas: int = 2) -> Router:
    """The tiny teacher in fp32 on `replicas` torch replicas that reuse shared prefixes of 16
    tokens and more (the shared-prefix suites' groups are short)."""
    from proctor.server.config import single_teacher_router

    spec = EngineSpec(name="torch", model_path=str(model_dir), dtype="float32", max_topk=8,
                      inference={"prompt_reuse_min_tokens": 16})
    return single_teacher_router(spec, name="tiny", replicas=replicas, health_check_interval_s=None)
