"""The front's side of a replica placed by Ray: `RayEngine`, an ordinary `TeacherEngine` whose
calls are remote calls to the replica's actor (`ray_worker.EngineActor`) on its bundle.

A lost actor (`RayActorError`, `ActorDiedError`, a node gone) surfaces as `EngineError`, so
routing treats it like any failed replica: the request is retried elsewhere and the replica
is restarted, which here means a new actor on the same bundle. A dead or wedged engine
inside a live actor fails `check_health`: the actor asks its engine (vLLM probes its
EngineCore), and an answer that does not come within the health timeout counts as failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import torch

from proctor.server.engines.base import (
    DEFAULT_TOKEN_BUDGET,
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineSpec,
    Outcome,
    TeacherEngine,
    started_info,
)
from proctor.server.worker.ray_worker import EngineActor


@dataclass(frozen=True)
class BundleRef:
    """Where one replica's actor goes: a placement group and a bundle index in it.

    `resources` is what the actor itself holds of the bundle besides CPUs: the replica's
    devices on one node; nothing for a replica spanning nodes (`spans_nodes`), whose group
    is its own and whose devices its engine's workers take, one bundle each.
    """

    placement_group: Any
    bundle_index: int
    resources: dict[str, float]
    spans_nodes: bool = False


# How long the actor may take to answer a health check: longer than the engine's own probe of
# its processes (vllm_common.PROBE_TIMEOUT_S, 10 s), so a wedged EngineCore is reported by the
# engine and a wedged actor by the missing answer.
HEALTH_TIMEOUT_S = 15.0
# How long a closing actor may take to shut its engine down (vLLM terminates its EngineCore,
# then kills it after a few seconds) before the actor is killed.
CLOSE_GRACE_S = 30.0


@functools.cache
def _remote_actor_class() -> Any:
    """`EngineActor` as a Ray actor class, made once and only when an actor is started (Ray is
    imported here, not with this module)."""
    import ray

    return ray.remote(EngineActor)


def _is_actor_loss(exc: BaseException) -> bool:
    import ray.exceptions as rx

    lost = (rx.RayActorError, getattr(rx, "ActorUnavailableError", rx.RayActorError), rx.WorkerCrashedError)
    return isinstance(exc, lost)


class RayEngine(TeacherEngine):
    """A TeacherEngine whose work happens in a Ray actor on a placement-group bundle."""

    def __init__(
        self,
        spec: EngineSpec,
        bundle: BundleRef,
        *,
        cpus: float = 1.0,
        env: dict[str, str] | None = None,
        health_timeout_s: float | None = None,
    ) -> None:
        self.spec = spec
        self.bundle = bundle
        self.cpus = cpus
        self.env = env or {}
        self.health_timeout_s = float(
            health_timeout_s or (spec.inference or {}).get("health_timeout_s") or HEALTH_TIMEOUT_S
        )
        self.actor = None
        self._info: EngineInfo | None = None
        self._budget = DEFAULT_TOKEN_BUDGET  # until the actor's engine says
        self._unembedding: torch.Tensor | None = None

    def _options(self) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = dict(self.bundle.resources)
        options: dict[str, Any] = {
            "num_cpus": self.cpus,
            "num_gpus": resources.pop("GPU", 0),
            "resources": resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.bundle.placement_group,
                placement_group_bundle_index=self.bundle.bundle_index,
                placement_group_capture_child_tasks=self.bundle.spans_nodes,
            ),
        }
        if self.env:
            options["runtime_env"] = {"env_vars": self.env}
        return options

    async def start(self) -> None:
        """Start the actor and its engine within `spec.startup_timeout_s`; on any failure the
        actor is killed, so that its bundle is free for the next attempt."""
        self.actor = _remote_actor_class().options(**self._options()).remote(self.spec)
        timeout = self.spec.startup_timeout_s
        try:
            self._info, self._budget = await asyncio.wait_for(self._call(self.actor.start.remote()), timeout)
        except TimeoutError as exc:
            await self.close()
            raise EngineError(
                f"Ray actor for {self.spec.model_path} did not start within {timeout:.0f}s "
                f"(inference.startup_timeout_s; are the bundle's resources {self.bundle.resources} available?)"
            ) from exc
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Let the engine shut its processes down, then kill the actor (which may be wedged)."""
        actor, self.actor = self.actor, None
        if actor is None:
            return
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(actor.close.remote(), CLOSE_GRACE_S)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

    def describe(self) -> EngineInfo:
        return started_info(self._info)

    def token_budget(self) -> int:
        return self._budget

    def unembedding(self) -> torch.Tensor:
        if self._unembedding is None:
            import ray

            if self.actor is None:
                raise EngineError("engine not started")
            self._unembedding = ray.get(self.actor.unembedding.remote())
        return self._unembedding

    async def fetch_unembedding(self) -> torch.Tensor:
        """From the actor's engine, awaited (not `ray.get` on the front's loop), once."""
        if self._unembedding is None:
            if self.actor is None:
                raise EngineError("engine not started")
            self._unembedding = await self._call(self.actor.unembedding.remote())
        return self._unembedding

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        if self.actor is None:
            raise EngineError("Ray actor is not running")
        return await self._call(self.actor.score.remote(batch))

    async def abort(self, request_keys: list[str]) -> None:
        """Forwarded to the actor's engine; nothing to abort when the actor is gone."""
        if self.actor is None:
            return
        with contextlib.suppress(EngineError):
            await self._call(self.actor.abort.remote(list(request_keys)))

    async def check_health(self) -> bool:
        """The engine's own check, answered within `health_timeout_s`; any failure is unhealthy."""
        if self.actor is None:
            return False
        try:
            return bool(await asyncio.wait_for(self._call(self.actor.check_health.remote()), self.health_timeout_s))
        except Exception:
            return False

    async def _call(self, ref: Awaitable) -> Any:
        try:
            return await ref
        except Exception as exc:
            if _is_actor_loss(exc):
                raise EngineError(f"Ray actor lost: {type(exc).__name__}: {exc}") from exc
            raise
