"""Replicas as Ray actors: placement groups for the plan's nodes, engines behind actor handles.

With `server.ray.enabled`, the placement plan maps onto Ray. Each replica's engine runs in
an actor; the service talks to it through `RayEngine`, an ordinary `TeacherEngine` whose
`score()` is a remote call. The actor is a replica worker like a local one (`worker.main`):
it answers results in wire form (`wire.EncodedResult`, a few `bytes` objects through
Ray's object store), so the front only splices them into answers.

Two shapes of placement group:

- **Replicas on one node** (the usual case): one placement group per plan node,
  `STRICT_PACK`, so replicas planned together land on one machine; one bundle per replica
  holding its devices (`GPU`, `NPU` or a custom resource) and its actor's CPUs. The actor
  holds the whole bundle and its engine sees exactly those devices.
- **A replica spanning nodes** (more devices than a node has, so the plan gave it whole
  nodes): one engine over vLLM's Ray executor, on a placement group of its own with one
  bundle per device, `{device: 1}`, the first bundle also holding the actor's CPUs. This is
  the shape vLLM 0.32 accepts (`ray_utils.initialize_ray_cluster`): a bundle may hold at
  most one device, and the executor starts one worker per device bundle, taking
  `{device: 1}` from it. The actor sits on bundle 0 holding only CPUs (its devices are
  the workers'), and `_verify_bundles` wants the driver's node (the EngineCore, a child of
  the actor) among the group's nodes, which bundle 0 guarantees. The strategy is `PACK`:
  `STRICT_PACK` cannot span nodes, and `STRICT_SPREAD` puts every bundle on a different
  node, which one bundle per device rules out (a node has several devices). `PACK` fills a
  node before taking the next, i.e. the replica's whole nodes when the cluster is the plan's
  (the plan gives a spanning replica whole nodes and never puts single-node replicas on
  them); it is also what vLLM itself would create. The actor captures child tasks, so that
  anything the engine starts without a placement of its own stays inside the replica's
  reservation. The group reaches the engine as `EngineSpec.placement_group`; the EngineCore
  connects to the same cluster through `RAY_ADDRESS`. vLLM counts a bundle's devices under
  its platform's resource name (`GPU` on CUDA), so a spanning vLLM replica needs that name
  as the device resource.

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
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
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
)
from proctor.server.pool import VISIBLE_DEVICES_ENV, PlacementPlan, ReplicaGroupPlan
from proctor.server.worker.wire import encode_outcomes

log = logging.getLogger(__name__)

# Ray's own resource for each device kind (it sets the *_VISIBLE_DEVICES of actors that hold them).
RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU"}
# How long the actor may take to answer a health check: longer than the engine's own probe of
# its processes (vllm_common.PROBE_TIMEOUT_S, 10 s), so a wedged EngineCore is reported by the
# engine and a wedged actor by the missing answer.
HEALTH_TIMEOUT_S = 15.0
# How long a closing actor may take to shut its engine down (vLLM terminates its EngineCore,
# then kills it after a few seconds) before the actor is killed.
CLOSE_GRACE_S = 30.0


class EngineActor:
    """Runs one engine inside a Ray actor (async: Ray gives it an event loop)."""

    def __init__(self, spec: EngineSpec) -> None:
        import os

        from proctor.server.engines.factory import create_engine

        if spec.placement_group is not None:
            # The actor of a spanning replica holds no device, and Ray hides every device from
            # such an actor; its engine's workers get theirs from their own bundles.
            for name in VISIBLE_DEVICES_ENV.values():
                if os.environ.get(name) == "":
                    os.environ.pop(name)
        from proctor.server.malloc_tuning import keep_large_buffers

        self.spec = spec
        keep_large_buffers()  # the actor is a replica worker: results' buffers reused, not re-faulted
        self.engine = create_engine(spec)

    async def start(self) -> tuple[EngineInfo, int]:
        await self.engine.start()
        return self.engine.describe(), self.engine.token_budget()

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        return encode_outcomes(await self.engine.score(batch))

    async def abort(self, request_keys: list[str]) -> None:
        await self.engine.abort(request_keys)

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
    """Where one replica's actor goes: a placement group and a bundle index in it.

    `resources` is what the actor itself holds of the bundle besides CPUs: the replica's
    devices on one node; nothing for a replica spanning nodes (`spans_nodes`), whose group
    is its own and whose devices its engine's workers take, one bundle each.
    """

    placement_group: Any
    bundle_index: int
    resources: dict[str, float]
    spans_nodes: bool = False


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
        # Names tell this server's groups from another's on the same cluster (`ray list placement-groups`).
        self.name = f"proctor-{uuid.uuid4().hex[:8]}"
        self._create()

    def _bundle(self, devices: int) -> dict[str, float]:
        bundle = {"CPU": float(self.settings.cpus_per_replica)}
        if self.resource:
            bundle[self.resource] = float(devices)
        return {k: v for k, v in bundle.items() if v > 0}

    def _create(self) -> None:
        from ray.util.placement_group import placement_group

        per_node: dict[int, list[ReplicaGroupPlan]] = {}
        for group in self.plan.groups:
            if len(group.slices) == 1:
                per_node.setdefault(group.node, []).append(group)
            else:
                self.bundles[group.group_id] = self._spanning(group)
        for node, groups in sorted(per_node.items()):
            bundles = [self._bundle(len(group.local_devices)) for group in groups]
            pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{self.name}-node{node}")
            self.placement_groups.append(pg)
            for index, group in enumerate(groups):
                devices = {k: v for k, v in bundles[index].items() if k != "CPU"}
                self.bundles[group.group_id] = BundleRef(pg, index, devices)

    def _spanning(self, group: ReplicaGroupPlan) -> BundleRef:
        """The own placement group of a replica spanning nodes: one bundle per device, `PACK`."""
        from ray.util.placement_group import placement_group

        if not self.resource:
            raise ValueError(
                f"replica {group.group_id} spans {len(group.slices)} nodes, so its engine's workers need one "
                f"device bundle each, but the device kind is {self.plan.device_kind!r} and server.ray.device_resource "
                "is unset: set server.ray.device_resource to the devices' Ray resource"
            )
        if self.resource not in RAY_RESOURCE.values():
            log.warning(
                "replica %s spans nodes on Ray resource %r: vLLM's Ray executor takes its devices under its "
                "platform's name (GPU on CUDA), so a vLLM engine will find no device bundle", group.group_id,
                self.resource,
            )
        bundles = [{self.resource: 1.0} for _ in range(group.size)]
        if self.settings.cpus_per_replica > 0:
            bundles[0]["CPU"] = float(self.settings.cpus_per_replica)
        pg = placement_group(bundles, strategy="PACK", name=f"{self.name}-{group.group_id}")
        self.placement_groups.append(pg)
        return BundleRef(pg, 0, {}, spans_nodes=True)

    def factory(self, spec: EngineSpec, group: ReplicaGroupPlan) -> Callable[[], Awaitable[TeacherEngine]]:
        """Builds a fresh actor on the replica's bundle (at start, and at every restart)."""
        import ray

        bundle = self.bundles[group.group_id]
        # Ray sets CUDA/ASCEND visibility for its GPU/NPU resources; for others, the plan's ids apply.
        env = {} if self.resource in ("GPU", "NPU") else group.visible_devices(self.plan.device_kind)
        if bundle.spans_nodes:
            spec = replace(spec, placement_group=bundle.placement_group)
            # The engine's EngineCore (a child process of the actor) joins this cluster as a driver.
            env = {**env, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}

        async def build() -> TeacherEngine:
            await asyncio.wait_for(bundle.placement_group.ready(), timeout=self.settings.start_timeout_s)
            return RayEngine(spec, bundle, cpus=self.settings.cpus_per_replica, env=env)

        return build

    def remove(self) -> None:
        """Release every placement group (the Router calls it once all replicas have stopped)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                log.exception("removing placement group %s failed", pg.id.hex())
        self.placement_groups.clear()
