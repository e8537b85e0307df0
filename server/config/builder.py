"""Building the server from a serving plan: replicas (in-process engines, swap groups or Ray
actors) behind a Router, and the runtime settings. The builder owns the Ray pool's lifetime:
the Router releases its placement groups once every replica has stopped.
"""

from __future__ import annotations

import typing
from dataclasses import replace
from functools import partial
from pathlib import Path

from proctor.server.config.plan import ServingPlan, load_plan
from proctor.server.config.schema import ConfigError
from proctor.server.engines.base import EngineSpec
from proctor.server.engines.prompt_reuse import ReuseSettings
from proctor.server.front.fleet.drift import DriftSettings
from proctor.server.worker.pool import ReplicaGroupPlan

if typing.TYPE_CHECKING:
    from proctor.server.front.fleet.replicas import EngineFactory, Replica
    from proctor.server.front.fleet.routing import Router
    from proctor.server.front.settings import ServerOptions
    from proctor.server.worker.ray_actor import RayPool



# ------------------------------------------------------------------------------------------
# Building the server
# ------------------------------------------------------------------------------------------


def _replica_spec(spec: EngineSpec, group: ReplicaGroupPlan, kind: str, *, in_process: bool) -> EngineSpec:
    """One replica's spec: its device ids; in-process replicas also address their first device."""
    device = kind
    if in_process and kind != "cpu":
        device = f"{kind}:{group.local_devices[0]}"
    return replace(spec, device=device, devices=tuple(str(d) for d in group.local_devices))


def _drift(spec: EngineSpec, *, swapped: bool) -> DriftSettings | None:
    """A teacher's drift check; none for a teacher sharing devices (each check would swap its weights in)."""
    return None if swapped else DriftSettings.from_inference(spec.inference)


def _in_process_factory(spec: EngineSpec, name: str, folder: str) -> EngineFactory:
    """An in-process replica's engine factory on another model folder (`checkpoint_move`)."""
    from proctor.server.front.fleet.replicas import engine_factory
    from proctor.server.worker.replica_engine import create_replica_engine

    return engine_factory(partial(create_replica_engine, replace(spec, model_path=folder), name=name))


def _in_process_replica(spec: EngineSpec, name: str, where: dict) -> Replica:
    """A replica whose engine runs in a replica worker of its own, movable to another model folder."""
    from proctor.server.front.fleet.replicas import Replica

    return Replica(name, _in_process_factory(spec, name, spec.model_path),
                   refactory=partial(_in_process_factory, spec, name), **where)


def _ray_factory(pool: RayPool, spec: EngineSpec, group: ReplicaGroupPlan, folder: str) -> EngineFactory:
    """A Ray replica's engine factory on another model folder (`checkpoint_move`)."""
    return pool.factory(replace(spec, model_path=folder), group)


def build_router(plan: ServingPlan) -> Router:
    """Teachers with their replicas (in-process engines, swap groups or Ray actors) behind a Router."""
    from proctor.server.engines.swap import SwapGroup, SwappedTeacherEngine
    from proctor.server.front.fleet.routing import Replica, ReplicaSet, RestartPolicy, Router, engine_replica

    server = plan.config.server
    ray_pool = None
    if server.ray.enabled:
        from proctor.server.worker.ray_actor import RayPool

        ray_pool = RayPool(plan.placement, server.ray)
    try:
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

        teachers = []
        for name, resolved in plan.teachers.items():
            replicas = []
            for group in plan.placement.groups_of(name):
                where = {"devices": tuple(map(str, group.local_devices)), "node": f"node{group.node}"}
                if group.shared:
                    replica_id = f"{name}@{group.group_id}"
                    build = partial(SwappedTeacherEngine, swap_groups[group.group_id], name)
                    replicas.append(engine_replica(replica_id, build, **where))
                elif ray_pool is not None:
                    spec = _replica_spec(resolved.spec, group, plan.device_kind, in_process=False)
                    replicas.append(Replica(group.group_id, ray_pool.factory(spec, group),
                                            refactory=partial(_ray_factory, ray_pool, spec, group), **where))
                else:
                    spec = _replica_spec(resolved.spec, group, plan.device_kind, in_process=True)
                    replicas.append(_in_process_replica(spec, group.group_id, where))
            teachers.append(
                ReplicaSet(
                    name,
                    replicas,
                    keys=(resolved.key,),
                    restart=RestartPolicy(server.restart_initial_backoff_s, server.restart_max_backoff_s),
                    policy=server.routing_policy,
                    health_check_interval_s=server.health_check_interval_s,
                    swap_groups=tuple({id(g): g for g in swap_groups.values() if name in g.specs}.values()),
                    prompt_reuse=ReuseSettings.from_inference(resolved.spec.inference),
                    tokenizer_path=resolved.spec.model_path,
                    drift=_drift(resolved.spec, swapped=any(name in g.specs for g in swap_groups.values())),
                )
            )
    except BaseException:  # nothing will own the pool's placement groups: release them now
        if ray_pool is not None:
            ray_pool.remove()
        raise
    # The Ray pool's placement groups are released once every replica (actor) has stopped.
    return Router(teachers, on_close=(ray_pool.remove,) if ray_pool is not None else ())


def server_options(plan: ServingPlan, *, host: str | None = None) -> ServerOptions:
    from proctor.server.front.auth import load_token
    from proctor.server.front.service import Limits
    from proctor.server.front.settings import ServerOptions

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
        http_header_timeout_s=s.http_header_timeout_s,
        http_max_connections=s.http_max_connections,
        student_tokenizers=dict(s.student_tokenizers),
        checkpoint_cache_dir=s.checkpoint_cache_dir,
    )


def convert_checkpoints(plan: ServingPlan) -> ServingPlan:
    """Each `dist_ckpt_path` converted (or found in the cache) and served: the teacher's spec then
    names the converted folder, so every engine, its unembedding and its fingerprint read the
    checkpoint's weights. Every refusal is collected, one line each naming the teacher's field."""
    from proctor.server.engines.base import EngineConfigError
    from proctor.server.engines.megatron.convert import materialize

    problems = []
    for name, teacher in plan.teachers.items():
        if not teacher.dist_ckpt_path:
            continue
        try:
            folder = materialize(teacher.dist_ckpt_path, teacher.spec.model_path, plan.config.server.checkpoint_cache_dir)
        except EngineConfigError as exc:
            problems.append(f"distillation.teacher_models.{name}.{exc}")
            continue
        plan.teachers[name] = replace(teacher, spec=replace(teacher.spec, model_path=str(folder)))
    if problems:
        raise ConfigError(problems)
    return plan


def load_server_config(path: str | Path, *, host: str | None = None) -> tuple[Router, ServerOptions]:
    """What `proctor serve --config` runs: the Router (engines not yet started) and ServerOptions."""
    plan = convert_checkpoints(load_plan(path))
    return build_router(plan), server_options(plan, host=host)


def _flag_replica_spec(spec: EngineSpec, index: int) -> EngineSpec:
    """Replica `index`'s spec: on CPU its device is `index`, as a config's plan numbers CPU devices
    (a vLLM replica binds its own cores from it, `engines/vllm/args.cpu_binding_environment`);
    an accelerator's replicas share the one device the flags name."""
    if spec.device == "cpu" and not spec.devices:
        return replace(spec, devices=(str(index),))
    return spec


def single_teacher_router(
    spec: EngineSpec, *, name: str = "default", replicas: int = 1, health_check_interval_s: float | None = 5.0
) -> Router:
    """What `proctor serve --model` runs: one teacher of `replicas` replicas (vLLM engines each
    in a replica worker of its own), routed by its name."""
    from proctor.server.front.fleet.routing import ReplicaSet, Router, engine_replica
    from proctor.server.worker.replica_engine import create_replica_engine

    ids = [f"{name}-{i}" for i in range(replicas)]
    replica_set = [engine_replica(i, partial(create_replica_engine, _flag_replica_spec(spec, index), name=i))
                   for index, i in enumerate(ids)]
    reuse = ReuseSettings.from_inference(spec.inference)
    return Router([ReplicaSet(name, replica_set, health_check_interval_s=health_check_interval_s, prompt_reuse=reuse,
                              tokenizer_path=spec.model_path, drift=DriftSettings.from_inference(spec.inference))])
