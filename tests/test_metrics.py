"""A real scrape of /metrics, parsed with prometheus-client's parser, shows exact counts."""

from __future__ import annotations

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proctor.proto import scoring_pb2, scoring_pb2_grpc


@pytest.fixture
def fresh_server(tiny_model_dir):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir))
    with ServerThread(single_teacher_router(spec, name="tiny"), ServerOptions(grpc_port=0, http_port=0)) as server:
        yield server


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_counts_after_known_traffic_are_exact(fresh_server):
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(fresh_server.grpc_target))
    lengths = [5, 9, 17]
    for n in lengths:
        stub.Score(scoring_pb2.ScoreRequest(token_ids=list(range(n)), logprobs=True))
    for n in (6, 7):
        httpx.post(fresh_server.http_url + "/v1/score", json={"token_ids": list(range(n)), "topk": 3})
    with pytest.raises(grpc.RpcError):
        stub.Score(scoring_pb2.ScoreRequest(token_ids=[1, 999], logprobs=True))

    samples = scrape(fresh_server.http_url)
    t = ("teacher", "tiny")
    grpc_, http = ("surface", "grpc"), ("surface", "proctor_http")  # each request under the surface it came through
    assert samples[("proctor:requests_total", (("mode", "logprobs"), ("outcome", "ok"), grpc_, t))] == 3
    assert samples[("proctor:requests_total", (("mode", "logprobs+topk"), ("outcome", "ok"), http, t))] == 2
    assert samples[("proctor:requests_total", (("mode", "logprobs"), ("outcome", "invalid_argument"), grpc_, t))] == 1
    assert samples[("proctor:scored_tokens_total", (("mode", "logprobs"), grpc_, t))] == sum(lengths)
    assert samples[("proctor:scored_tokens_total", (("mode", "logprobs+topk"), http, t))] == 13
    assert samples[("proctor:request_latency_seconds_count", (t,))] == 5
    assert samples[("proctor:queue_time_seconds_count", (t,))] == 5
    assert samples[("proctor:engine_time_seconds_count", (t,))] == 5
    assert samples[("proctor:response_bytes_total", (("mode", "logprobs"), t))] > 0
    assert samples[("proctor:replica_healthy", (("replica", "tiny-0"), t))] == 1
    assert samples[("proctor:requests_waiting", (t,))] == 0
    assert samples[("proctor:requests_running", (t,))] == 0


def test_metrics_can_also_be_served_on_their_own_port(tiny_model_dir):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir))
    options = ServerOptions(grpc_port=0, http_port=0, metrics_port=0)
    with ServerThread(single_teacher_router(spec, name="tiny"), options) as server:
        httpx.post(server.http_url + "/v1/score", json={"token_ids": [1, 2, 3]})
        text = httpx.get(f"http://127.0.0.1:{server.server.metrics_port}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (ok,) = [s for s in families["proctor:requests"].samples if s.labels.get("outcome") == "ok"]
    assert ok.value == 1
