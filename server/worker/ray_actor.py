"""Replicas as Ray actors: placement groups for the plan's nodes, engines behind actor handles.

With `server.ray.enabled`, the placement plan maps onto Ray. Each replica's engine runs in
an actor (`ray_worker.EngineActor`); the service talks to it through `ray_engine.RayEngine`, an
ordinary `TeacherEngine` whose `score()` is a remote call. This module is the part the server's
config builder uses: `RayPool`, the plan's placement groups and an engine factory per replica
that puts the replica's actor on its bundle.

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

A restarted replica gets a new actor on the same bundle: the groups live as long as the pool.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from proctor.server.engines.base import EngineSpec, TeacherEngine
from proctor.server.engines.invariance import invariance_environment
from proctor.server.worker.pool import PlacementPlan, ReplicaGroupPlan
from proctor.server.worker.ray_engine import BundleRef, RayEngine

log = logging.getLogger(__name__)

# Ray's own resource for each device kind (it sets the *_VISIBLE_DEVICES of actors that hold them).
RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU"}


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
        env = {**env, **invariance_environment(spec)}  # vLLM's batch-invariant switch, when asked for
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
