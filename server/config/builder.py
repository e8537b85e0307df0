"""Building the server from a serving plan: replicas (in-process engines, swap groups or Ray
actors) behind a Router, and the runtime settings. The builder owns the Ray pool's lifetime:
the Router releases its placement groups once every replica has stopped.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from proctor.server.config.plan import ServingPlan, load_plan
from proctor.server.engines import EngineSpec
from proctor.server.pool import ReplicaGroupPlan

if typing.TYPE_CHECKING:
    from proctor.server.routing import Router
    from proctor.server.runtime import ServerOptions



# ------------------------------------------------------------------------------------------
# Building the server
# ------------------------------------------------------------------------------------------


def _replica_spec(spec: EngineSpec, group: ReplicaGroupPlan, kind: str, *, in_process: bool) -> EngineSpec:
    """One replica's spec: its device ids; in-process replicas also address their first device."""
    device = kind
    if in_process and kind != "cpu":
        device = f"{kind}:{group.local_devices[0]}"
    return replace(spec, device=device, devices=tuple(str(d) for d in group.local_devices))


def build_router(plan: ServingPlan) -> Router:
    """Teachers with their replicas (in-process engines, swap groups or Ray actors) behind a Router."""
    from proctor.server.engines import create_replica_engine
    from proctor.server.routing import Replica, ReplicaSet, RestartPolicy, Router
    from proctor.server.swap import SwapGroup, SwappedTeacherEngine

    server = plan.config.server
    ray_pool = None
    if server.ray.enabled:
        from proctor.server.ray_replica import RayPool

        ray_pool = RayPool(plan.placement, server.ray)
    swap_groups: dict[str, SwapGroup] = {}
    for group in plan.placement.groups:
        if group.shared:
            specs = {
                n: _replica_spec(plan.teachers[n].spec, group, plan.device_kind, in_process=True)
                for n in group.teachers
            }
            swap_groups[group.group_id] = SwapGroup(
                group.group_id, specs, max_consecutive_batches=server.swap_max_consecutive_batches
            )

    def in_process(spec: EngineSpec, replica_id: str) -> Callable:
        async def build():
            return create_replica_engine(spec, name=replica_id)

        return build

    def swapped(group: SwapGroup, teacher: str) -> Callable:
        async def build():
            return SwappedTeacherEngine(group, teacher)

        return build

    teachers = []
    for name, resolved in plan.teachers.items():
        replicas = []
        for group in plan.placement.groups_of(name):
            if group.shared:
                factory = swapped(swap_groups[group.group_id], name)
                replica_id = f"{name}@{group.group_id}"
            elif ray_pool is not None:
                factory = ray_pool.factory(
                    _replica_spec(resolved.spec, group, plan.device_kind, in_process=False), group
                )
                replica_id = group.group_id
            else:
                replica_id = group.group_id
                factory = in_process(_replica_spec(resolved.spec, group, plan.device_kind, in_process=True), replica_id)
            replicas.append(
                Replica(replica_id, factory, devices=tuple(map(str, group.local_devices)), node=f"node{group.node}")
            )
        teachers.append(
            ReplicaSet(
                name,
                replicas,
                keys=(resolved.key,),
                restart=RestartPolicy(server.restart_initial_backoff_s, server.restart_max_backoff_s),
                policy=server.routing_policy,
                health_check_interval_s=server.health_check_interval_s,
                swap_groups=tuple({id(g): g for g in swap_groups.values() if name in g.specs}.values()),
            )
        )
    # The Ray pool's placement groups are released once every replica (actor) has stopped.
    return Router(teachers, on_close=(ray_pool.remove,) if ray_pool is not None else ())


def server_options(plan: ServingPlan, *, host: str | None = None) -> ServerOptions:
    from proctor.server.auth import load_token
    from proctor.server.runtime import ServerOptions
    from proctor.server.service import Limits

    s = plan.config.server
    return ServerOptions(
        host=host or s.host,
        grpc_port=s.grpc_port,
        http_port=s.http_port,
        auth_token=load_token(token_file=s.auth_token_file),
        max_message_bytes=s.max_message_bytes,
        stream_chunk_bytes=s.stream_chunk_bytes,
        drain_grace_s=s.drain_grace_s,
        limits=Limits(
            max_queue_requests=s.max_queue_requests,
            max_queue_tokens=s.max_queue_tokens,
            default_timeout_s=s.request_timeout_s,
        ),
        tls_cert_file=s.tls.cert_file,
        tls_key_file=s.tls.key_file,
        tls_client_ca_file=s.tls.client_ca_file,
        open_paths=tuple(s.open_paths),
        metrics_port=s.metrics_port,
    )


def load_server_config(path: str | Path, *, host: str | None = None) -> tuple[Router, ServerOptions]:
    """What `proctor serve --config` runs: the Router (engines not yet started) and ServerOptions."""
    plan = load_plan(path)
    return build_router(plan), server_options(plan, host=host)
