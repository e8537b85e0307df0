"""Routing inside a teacher: least outstanding tokens, health sweeps, UNAVAILABLE when none is left."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from proctor.server.common.errors import Code, ScoringError
from proctor.server.front.fleet.routing import Replica, ReplicaSet, ReplicaState, Router

from support.reference import assert_matches_reference
from support.routers import InjectedReplicas
from support.scoring import grpc_score, logprobs_of, sequences
from support.servers import wait_for

SLOW_PER_TOKEN_S = 0.004  # a 20-token request costs the slow replica ~80 ms more than the fast one


def _slow_share(tiny_model_dir, policy: str) -> tuple[int, int]:
    replicas = InjectedReplicas(tiny_model_dir, delays=[0.0, SLOW_PER_TOKEN_S], policy=policy)
    server = replicas.serve()
    try:
        work = sequences(48, seed=3, length=(16, 24))
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda ids: grpc_score(server.grpc_target, ids), work))
        for ids, answer in zip(work[:4], answers[:4], strict=True):
            assert_matches_reference(logprobs_of(answer), tiny_model_dir, ids, atol=1e-5)
        fast, slow = (e.requests for e in replicas.engines)
        assert fast + slow == len(work)
        return slow, len(work)
    finally:
        server.stop()


def test_least_outstanding_sends_a_slow_replica_fewer_requests_than_round_robin(tiny_model_dir):
    rr_slow, total = _slow_share(tiny_model_dir, "round_robin")
    lo_slow, _ = _slow_share(tiny_model_dir, "least_outstanding")
    assert rr_slow == total // 2  # round robin ignores load
    assert lo_slow < rr_slow
    assert lo_slow <= total * 0.35, f"slow replica got {lo_slow}/{total}"


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round_robin"):
        ReplicaSet("t", [Replica("r", None)], policy="random")


def test_single_teacher_needs_no_key_but_an_unknown_one_is_not_found():
    teacher = ReplicaSet("only", [Replica("r", None)], keys=("k",))
    router = Router([teacher])
    assert router.route("") is teacher and router.route("k") is teacher and router.route("only") is teacher
    with pytest.raises(ScoringError) as err:
        router.route("other")
    assert err.value.code is Code.NOT_FOUND


def test_replica_that_dies_while_idle_is_found_by_the_health_sweep_and_restarted(tiny_model_dir):
    replicas = InjectedReplicas(tiny_model_dir, delays=[0.0, 0.0], health_check_interval_s=0.1)
    server = replicas.serve()
    try:
        first = replicas.engines[0]
        first.kill()  # no request is sent: only the sweep can notice
        wait_for(lambda: replicas.replicas[0].restarts == 1 and replicas.replicas[0].state is ReplicaState.HEALTHY)
        assert replicas.engines[0] is not first and replicas.replicas[0].failures == 1
        assert replicas.replicas[1].failures == 0
    finally:
        server.stop()


def test_teacher_without_a_healthy_replica_answers_unavailable_with_a_retry_hint(tiny_model_dir):
    replicas = InjectedReplicas(tiny_model_dir, delays=[0.0])
    server = replicas.serve()
    try:
        ids = sequences(1, seed=9)[0]
        replicas.fail_restarts = True
        replicas.engines[0].kill()
        body = {"token_ids": ids, "logprobs": True}
        response = httpx.post(f"{server.http_url}/v1/score", json=body)
        assert response.status_code == 503, response.text
        assert "no healthy replica" in response.json()["error"]["message"]
        assert int(response.headers["Retry-After"]) >= 1
        replicas.fail_restarts = False  # the device is back: the restart loop brings the replica in
        wait_for(lambda: replicas.replicas[0].state is ReplicaState.HEALTHY)
        answer = grpc_score(server.grpc_target, ids)
        assert_matches_reference(logprobs_of(answer), tiny_model_dir, ids, atol=1e-5)
    finally:
        server.stop()
