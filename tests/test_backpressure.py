"""Overload, cancellation, deadlines and drain: nothing admitted is lost, nothing waits unbounded."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.server.front.runtime import ServerThread
from proctor.server.front.service import Limits
from proctor.server.front.settings import ServerOptions

from support.drain import start_drain_server
from support.routers import slow_router


def _request(i: int) -> scoring_pb2.ScoreRequest:
    return scoring_pb2.ScoreRequest(token_ids=[1, 2, 3, i % 500], logprobs=True, request_id=f"r{i}")


@pytest.fixture
def slow_server(tiny_model_dir):
    router, engines = slow_router(tiny_model_dir, 0.6)
    with ServerThread(router, ServerOptions(grpc_port=0, http_port=0, limits=Limits(max_queue_requests=4))) as server:
        yield server, engines[0]


def _outcomes(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(server.http_url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "proctor:requests_total":
                counts[sample.labels["outcome"]] = counts.get(sample.labels["outcome"], 0) + sample.value
    return counts


def test_burst_past_the_queue_is_refused_at_once_and_admitted_work_completes(slow_server):
    server, engine = slow_server
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))
    started = time.monotonic()
    futures = [stub.Score.future(_request(i)) for i in range(12)]
    finished_at: dict[int, float] = {}
    for index, future in enumerate(futures):
        future.add_done_callback(lambda _f, i=index: finished_at.setdefault(i, time.monotonic() - started))
    answered, refused = [], []
    for index, future in enumerate(futures):
        try:
            answered.append(future.result(timeout=30))
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hints = dict(error.trailing_metadata())
            assert float(hints["retry-after"]) > 0 and int(hints["grpc-retry-pushback-ms"]) > 0
            refused.append(finished_at[index])
    assert len(answered) == 4 and len(refused) == 8
    assert max(refused) < 0.6, "refusals waited for the engine instead of coming at once"
    assert sorted(r.request_id for r in answered) == sorted(engine.scored_ids)
    reply = httpx.post(server.http_url + "/v1/score", json={"token_ids": [1, 2]})
    assert reply.status_code == 200  # the queue drained; the server admits again


def test_http_overload_is_429_with_retry_after(slow_server):
    server, _ = slow_server
    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda i: httpx.post(server.http_url + "/v1/score", json={"token_ids": [1, 2, i]},
                                                     timeout=30), range(10)))
    limited = [r for r in replies if r.status_code == 429]
    assert limited and all(int(r.headers["retry-after"]) >= 1 for r in limited)
    assert all(r.status_code in (200, 429) for r in replies)


def test_cancelled_request_leaves_the_queue_without_compute(slow_server):
    server, engine = slow_server
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))
    busy = stub.Score.future(_request(1))
    time.sleep(0.15)
    doomed = stub.Score.future(_request(2))
    time.sleep(0.15)
    doomed.cancel()
    busy.result(timeout=10)
    time.sleep(0.8)  # long enough for another batch, had the request stayed queued
    assert engine.scored_ids == ["r1"]
    assert _outcomes(server).get("cancelled") == 1


def test_deadline_is_honoured_and_the_expired_request_is_not_scored(slow_server):
    server, engine = slow_server
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))
    busy = stub.Score.future(_request(1))
    time.sleep(0.1)
    with ThreadPoolExecutor(1) as pool:  # both expire while the engine is still busy with r1
        http = pool.submit(httpx.post, server.http_url + "/v1/score", json={"token_ids": [1, 2, 3], "request_id": "h3"},
                           headers={"x-request-timeout": "0.2"})
        with pytest.raises(grpc.RpcError) as info:
            stub.Score(_request(2), timeout=0.2)
        reply = http.result()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "DEADLINE_EXCEEDED"
    busy.result(timeout=10)
    time.sleep(0.8)
    assert engine.scored_ids == ["r1"]


def test_sigterm_drains_admitted_requests_and_exits_zero(tiny_model_dir):
    proc, target, _ = start_drain_server(tiny_model_dir, delay=0.4)
    channel = grpc.insecure_channel(target)
    stub = scoring_pb2_grpc.TeacherScoringStub(channel)
    futures = [stub.Score.future(_request(i)) for i in range(1, 9)]
    time.sleep(0.2)  # all eight are admitted (one batch running, the rest waiting)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as late:
        stub.Score(_request(99), timeout=5)
    assert late.value.code() == grpc.StatusCode.UNAVAILABLE
    answers = [f.result(timeout=30) for f in futures]
    assert sorted(a.request_id for a in answers) == sorted(f"r{i}" for i in range(1, 9))
    assert proc.wait(timeout=60) == 0
