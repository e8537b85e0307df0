"""Failover: a replica killed under continuous load loses no request, answers none twice, comes back."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from proctor.server.front.fleet.routing import ReplicaState

from support.reference import assert_matches_reference
from support.routers import InjectedReplicas
from support.scoring import grpc_score, logprobs_of, sequences
from support.servers import wait_for


def test_replica_killed_under_load_loses_no_request_and_rejoins(tiny_model_dir):
    # A small per-token delay keeps requests queued in each replica's batcher when the kill lands.
    replicas = InjectedReplicas(tiny_model_dir, delays=[0.001, 0.001])
    server = replicas.serve()
    try:
        work = {f"req-{i}": ids for i, ids in enumerate(sequences(120, seed=21, length=(10, 30)))}
        answered: dict[str, list] = {}
        lock = threading.Lock()
        victim = replicas.engines[0]

        def call(item):
            request_id, ids = item
            response = grpc_score(server.grpc_target, ids, request_id=request_id)
            with lock:
                answered.setdefault(response.request_id, []).append(response)
            return response

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, item) for item in work.items()]
            wait_for(lambda: len(answered) >= 30, timeout=60, interval=0.005)
            victim.kill()  # mid-run: its current batch fails, its queued requests are orphaned
            errors = [f.exception() for f in futures]
        assert errors == [None] * len(work)
        assert victim.requests < len(work) and replicas.replicas[0].failures == 1

        # Every request answered exactly once, by the right sequence's scores.
        assert sorted(answered) == sorted(work)
        assert all(len(responses) == 1 for responses in answered.values())
        for request_id, (response,) in answered.items():
            assert_matches_reference(logprobs_of(response), tiny_model_dir, work[request_id], atol=1e-5)

        # The dead replica was restarted and takes load again.
        wait_for(lambda: replicas.replicas[0].state is ReplicaState.HEALTHY and replicas.replicas[0].restarts == 1)
        reborn = replicas.engines[0]
        assert reborn is not victim
        more = sequences(24, seed=22, length=(10, 30))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda ids: grpc_score(server.grpc_target, ids), more))
        assert reborn.requests > 0
    finally:
        server.stop()


def test_requests_on_a_replica_that_hangs_are_retried_once_the_health_sweep_takes_it_out(tiny_model_dir):
    replicas = InjectedReplicas(tiny_model_dir, delays=[0.002, 0.002], health_check_interval_s=0.2)
    server = replicas.serve()
    try:
        replicas.engines[0].freeze()  # wedged: its batch and everything queued behind it never return
        work = sequences(16, seed=24, length=(10, 30))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda ids: grpc_score(server.grpc_target, ids, timeout=30), work))
        for ids, answer in zip(work, answers, strict=True):
            assert_matches_reference(logprobs_of(answer), tiny_model_dir, ids, atol=1e-5)
        assert replicas.replicas[0].failures == 1
        assert replicas.engines[1].requests + replicas.engines[0].requests == len(work)
    finally:
        server.stop()


def test_dead_replica_is_skipped_while_it_restarts(tiny_model_dir):
    replicas = InjectedReplicas(tiny_model_dir, delays=[0.0, 0.0])
    server = replicas.serve()
    try:
        replicas.fail_restarts = True
        replicas.engines[1].kill()
        started = time.monotonic()
        for ids in sequences(10, seed=23):
            answer = grpc_score(server.grpc_target, ids)
            assert_matches_reference(logprobs_of(answer), tiny_model_dir, ids, atol=1e-5)
        assert time.monotonic() - started < 20
        assert replicas.replicas[1].state is not ReplicaState.HEALTHY
        assert replicas.engines[0].requests == 10 and replicas.engines[1].requests == 0
    finally:
        server.stop()
