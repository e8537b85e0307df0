"""Replicas as Ray actors on placement groups of a local Ray cluster; a killed actor fails over."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from proctor.server.config import load_server_config
from proctor.server.routing import ReplicaState
from proctor.server.runtime import ServerThread

from scoring_helpers import (
    cpu_config,
    grpc_score,
    logprobs_of,
    reference_logprobs,
    sequences,
    torch_teacher,
    wait_for,
    write_config,
)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, resources={"fake_gpu": 4}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory, tiny_model_dir):
    ray_settings = {"enabled": True, "device_resource": "fake_gpu", "cpus_per_replica": 0.5, "start_timeout_s": 120}
    doc = cpu_config({"t": torch_teacher(tiny_model_dir, num_replicas=None)}, devices=2, server={"ray": ray_settings})
    router, options = load_server_config(write_config(tmp_path_factory.mktemp("cfg"), doc))
    server = ServerThread(router, options).start()
    yield server
    server.stop()


def _replicas(server):
    return server.server.service.router.teachers["t"].replicas


def test_replicas_run_as_actors_on_their_placement_group_bundles(ray_server, tiny_model_dir):
    replicas = _replicas(ray_server)
    assert [r.engine.bundle.bundle_index for r in replicas] == [0, 1]
    assert replicas[0].engine.bundle.placement_group == replicas[1].engine.bundle.placement_group
    table = ray.util.placement_group_table(replicas[0].engine.bundle.placement_group)
    assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
    assert list(table["bundles"].values()) == [{"CPU": 0.5, "fake_gpu": 1.0}] * 2
    actors = {r.engine.actor._actor_id.hex() for r in replicas}
    assert len(actors) == 2
    for ids in sequences(6, seed=31):
        answer = grpc_score(ray_server.grpc_target, ids)
        torch.testing.assert_close(logprobs_of(answer), reference_logprobs(tiny_model_dir, ids), rtol=0, atol=1e-5)


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
