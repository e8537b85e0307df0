"""Replicas as Ray actors: placement groups for the plan's nodes, engines behind actor handles.

With `server.ray.enabled`, the placement plan maps onto Ray: one placement group per plan
node (`STRICT_PACK`, so replicas planned together land on one machine), one bundle per
replica holding its devices (`GPU`, `NPU` or a custom resource). Each replica's engine
runs in an actor scheduled on its bundle; the service talks to it through `RayEngine`, an
ordinary `TeacherEngine` whose `score()` is a remote call (requests and results travel as
pickled dataclasses holding torch tensors, through Ray's object store).

A lost actor (`RayActorError`, `ActorDiedError`, a node gone) surfaces as `EngineError`, so
routing treats it like any failed replica: the request is retried elsewhere and the replica
is restarted, which here means a new actor on the same bundle.

Multi-node replicas (more devices than a node has) get one whole-node bundle per node; the
actor runs on the first, and engines that spread over nodes (vLLM's Ray executor) use the
placement group given to them in `inference["ray_placement_groups"]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from proctor.server.engines.base import (
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineResult,
    EngineSpec,
    TeacherEngine,
)
from proctor.server.pool import PlacementPlan, ReplicaGroupPlan

log = logging.getLogger(__name__)

# Ray's own resource for each device kind (it sets the *_VISIBLE_DEVICES of actors that hold them).
RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU"}


class EngineActor:
    """Runs one engine inside a Ray actor (async: Ray gives it an event loop)."""

    def __init__(self, spec: EngineSpec) -> None:
        from proctor.server.engines import create_engine

        self.spec = spec
        self.engine = create_engine(spec)

    async def start(self) -> tuple[EngineInfo, int]:
        await self.engine.start()
        return self.engine.describe(), self.engine.token_budget()

    async def score(self, batch: list[EngineRequest]) -> list[EngineResult]:
        return await self.engine.score(batch)

    def unembedding(self) -> torch.Tensor:
        return self.engine.unembedding()

    async def check_health(self) -> bool:
        return await self.engine.check_health()

    async def close(self) -> None:
        await self.engine.close()


@functools.cache
def _remote_actor_class():
    import ray

    return ray.remote(EngineActor)


def _is_actor_loss(exc: BaseException) -> bool:
    import ray.exceptions as rx

    lost = (rx.RayActorError, getattr(rx, "ActorUnavailableError", rx.RayActorError), rx.WorkerCrashedError)
    return isinstance(exc, lost)


@dataclass(frozen=True)
class BundleRef:
    """Where one replica's actor goes: a placement group and a bundle index in it."""

    placement_group: Any
    bundle_index: int
    resources: dict[str, float]
    extra_groups: tuple[Any, ...] = ()  # the other nodes of a multi-node replica


class RayEngine(TeacherEngine):
    """A TeacherEngine whose work happens in a Ray actor on a placement-group bundle."""

    def __init__(
        self,
        spec: EngineSpec,
        bundle: BundleRef,
        *,
        cpus: float = 1.0,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 600.0,
        health_timeout_s: float = 30.0,
    ) -> None:
        self.spec = spec
        self.bundle = bundle
        self.cpus = cpus
        self.env = env or {}
        self.start_timeout_s = start_timeout_s
        self.health_timeout_s = health_timeout_s
        self.actor = None
        self._info: EngineInfo | None = None
        self._budget = 8192
        self._unembedding: torch.Tensor | None = None

    async def start(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = dict(self.bundle.resources)
        gpus = resources.pop("GPU", 0)
        options: dict[str, Any] = {
            "num_cpus": self.cpus,
            "num_gpus": gpus,
            "resources": resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.bundle.placement_group,
                placement_group_bundle_index=self.bundle.bundle_index,
            ),
        }
        if self.env:
            options["runtime_env"] = {"env_vars": self.env}
        self.actor = _remote_actor_class().options(**options).remote(self.spec)
        try:
            self._info, self._budget = await asyncio.wait_for(
                self._call(self.actor.start.remote()), timeout=self.start_timeout_s
            )
        except asyncio.TimeoutError as exc:
            await self.close()
            raise EngineError(
                f"Ray actor for {self.spec.model_path} did not start within {self.start_timeout_s:.0f}s "
                f"(are the bundle's resources {self.bundle.resources} available?)"
            ) from exc

    async def close(self) -> None:
        actor, self.actor = self.actor, None
        if actor is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def describe(self) -> EngineInfo:
        if self._info is None:
            raise EngineError("engine not started")
        return self._info

    def token_budget(self) -> int:
        return self._budget

    def unembedding(self) -> torch.Tensor:
        if self._unembedding is None:
            import ray

            if self.actor is None:
                raise EngineError("engine not started")
            self._unembedding = ray.get(self.actor.unembedding.remote())
        return self._unembedding

    async def score(self, batch: list[EngineRequest]) -> list[EngineResult]:
        if self.actor is None:
            raise EngineError("Ray actor is not running")
        return await self._call(self.actor.score.remote(batch))

    async def check_health(self) -> bool:
        if self.actor is None:
            return False
        try:
            return bool(await asyncio.wait_for(self._call(self.actor.check_health.remote()), self.health_timeout_s))
        except (EngineError, asyncio.TimeoutError):
            return False

    async def _call(self, ref: Awaitable) -> Any:
        try:
            return await ref
        except Exception as exc:
            if _is_actor_loss(exc):
                raise EngineError(f"Ray actor lost: {type(exc).__name__}: {exc}") from exc
            raise


class RayPool:
    """The plan's placement groups on a Ray cluster, and engine factories for its replicas."""

    def __init__(self, plan: PlacementPlan, settings: Any) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=settings.address, namespace=settings.namespace, ignore_reinit_error=True)
        self.plan = plan
        self.settings = settings
        self.resource = settings.device_resource or RAY_RESOURCE.get(plan.device_kind)
        self.bundles: dict[str, BundleRef] = {}
        self.placement_groups: list[Any] = []
        self._create()

    def _bundle(self, devices: int) -> dict[str, float]:
        bundle = {"CPU": float(self.settings.cpus_per_replica)}
        if self.resource:
            bundle[self.resource] = float(devices)
        return {k: v for k, v in bundle.items() if v > 0}

    def _create(self) -> None:
        from ray.util.placement_group import placement_group

        per_node: dict[int, list[tuple[ReplicaGroupPlan, int]]] = {}
        for group in self.plan.groups:
            for slice_index, node_slice in enumerate(group.slices):
                per_node.setdefault(node_slice.node, []).append((group, slice_index))
        where: dict[tuple[str, int], tuple[Any, int]] = {}
        for node, entries in sorted(per_node.items()):
            bundles = [self._bundle(len(group.slices[i].devices)) for group, i in entries]
            pg = placement_group(bundles, strategy="STRICT_PACK", name=f"proctor-node{node}")
            self.placement_groups.append(pg)
            for index, (group, slice_index) in enumerate(entries):
                where[(group.group_id, slice_index)] = (pg, index)
        for group in self.plan.groups:
            pg, index = where[(group.group_id, 0)]
            resources = {k: v for k, v in self._bundle(len(group.slices[0].devices)).items() if k != "CPU"}
            extra = tuple(where[(group.group_id, i)][0] for i in range(1, len(group.slices)))
            self.bundles[group.group_id] = BundleRef(pg, index, resources, extra)

    def factory(self, spec: EngineSpec, group: ReplicaGroupPlan) -> Callable[[], Awaitable[TeacherEngine]]:
        """Builds a fresh actor on the replica's bundle (at start, and at every restart)."""
        bundle = self.bundles[group.group_id]
        # Ray sets CUDA/ASCEND visibility for its GPU/NPU resources; for others, the plan's ids apply.
        env = {} if self.resource in ("GPU", "NPU") else group.visible_devices(self.plan.device_kind)
        if bundle.extra_groups:
            spec = replace(spec, inference={**spec.inference, "ray_placement_groups": bundle.extra_groups})

        async def build() -> TeacherEngine:
            await asyncio.wait_for(bundle.placement_group.ready(), timeout=self.settings.start_timeout_s)
            return RayEngine(
                spec,
                bundle,
                cpus=self.settings.cpus_per_replica,
                env=env,
                start_timeout_s=self.settings.start_timeout_s,
            )

        return build

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self.placement_groups.clear()
