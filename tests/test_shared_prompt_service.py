"""Shared prompts through a real server (gRPC on loopback, two torch replicas): no client change,
a group's members follow its prompt to one replica, the metrics count reuse, and a member retried
on another replica after its replica failed is still exact."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import decode_tensor

from support.groups import FP32_ATOL, interleaved, make_groups
from support.reference import reference_rows
from support.routers import reuse_router
from support.servers import metric_value, start_server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = start_server(reuse_router(tiny_model_dir))
    yield server
    server.stop()


def _score(stub, member, topk: int = 3) -> scoring_pb2.ScoreResponse:
    request = scoring_pb2.ScoreRequest(request_id=f"g{member.group}m{member.index}", token_ids=member.token_ids.tolist(),
                                       prompt_length=member.prompt_length, logprobs=True, topk=topk)
    return stub.Score(request, timeout=60)


def _check(response, member, model_dir) -> None:
    ref = reference_rows(model_dir, member.token_ids.tolist(), member.prompt_length)
    torch.testing.assert_close(decode_tensor(response.logprobs).double(), ref.logprobs, rtol=0, atol=FP32_ATOL)
    ids, _ = ref.topk(3)
    assert torch.equal(decode_tensor(response.topk_ids).long(), ids)


def test_a_group_follows_its_prompt_to_one_replica_and_is_counted(server, tiny_model_dir):
    groups = make_groups([48, 70, 33], 6, response=(1, 20), seed=31)
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))
    teacher = server.server.service.router.teachers["tiny"]
    before = {r.replica_id: r.served for r in teacher.replicas}
    hits, misses = metric_value(server, "proctor:prompt_reuse_hits_total"), metric_value(server, "proctor:prompt_reuse_misses_total")
    tokens = metric_value(server, "proctor:prompt_reuse_tokens_total")
    arrivals = interleaved(groups, seed=4)
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda m: _score(stub, m), arrivals))
    for member, response in zip(arrivals, responses, strict=True):
        _check(response, member, tiny_model_dir)
    # One miss per group: had a group's members gone to both replicas, each would have computed it.
    assert sum(r.served - before[r.replica_id] for r in teacher.replicas) == len(arrivals)
    assert metric_value(server, "proctor:prompt_reuse_misses_total") - misses == 3
    assert metric_value(server, "proctor:prompt_reuse_hits_total") - hits == len(arrivals) - 3
    # Each member after its group's first ran only its prompt's last position and its response.
    followers = len(arrivals) - 3
    assert metric_value(server, "proctor:prompt_reuse_tokens_total") - tokens == sum(
        m.prompt_length for m in arrivals) - (48 + 70 + 33) - followers


async def _fail(teacher, replica) -> None:
    teacher.mark_failed(replica, RuntimeError("taken out by the test"))


def test_a_member_retried_on_another_replica_is_exact(server, tiny_model_dir):
    (group,) = make_groups([60], 6, response=(2, 15), seed=41)
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))
    teacher = server.server.service.router.teachers["tiny"]
    before = {r.replica_id: r.served for r in teacher.replicas}
    misses = metric_value(server, "proctor:prompt_reuse_misses_total")
    for member in group[:3]:
        _check(_score(stub, member), member, tiny_model_dir)
    (holder,) = [r for r in teacher.replicas if r.served - before[r.replica_id] == 3]  # all three went there
    asyncio.run_coroutine_threadsafe(_fail(teacher, holder), server.loop).result(10)
    for member in group[3:]:  # the prompt's replica is gone: the other computes it once, exactly
        _check(_score(stub, member), member, tiny_model_dir)
    (other,) = [r for r in teacher.replicas if r is not holder]
    assert other.served - before[other.replica_id] == 3
    assert metric_value(server, "proctor:prompt_reuse_misses_total") - misses == 2


def test_trls_client_with_no_prompt_length_reuses_each_groups_prompt(server, tiny_model_dir):
    """TRL's VLLMClient, unmodified: every row from 1, no prompt length on the wire. The replicas find
    each group's prompt themselves; every row equals the transformers reference."""
    pytest.importorskip("vllm", reason="TRL's VLLMClient refuses to start without vLLM installed beside it")
    from trl.generation.vllm_client import VLLMClient

    groups = make_groups([40, 66], 4, response=(2, 12), seed=53)
    arrivals = interleaved(groups, seed=6)
    hits, misses = metric_value(server, "proctor:prompt_reuse_hits_total"), metric_value(
        server, "proctor:prompt_reuse_misses_total")
    computed = metric_value(server, "proctor:engine_computed_tokens_total")
    client = VLLMClient(base_url=server.http_url)
    sequences = [m.token_ids.tolist() for m in arrivals]
    out = client.get_sequence_logprobs(sequences, [1] * len(sequences), top_logprobs=3, chunk_size=1,
                                       max_concurrent_requests=4)
    for index, ids in enumerate(sequences):
        ref = reference_rows(tiny_model_dir, ids)
        torch.testing.assert_close(torch.tensor(out["actual_logprobs"][index], dtype=torch.float64)[:, 0],
                                   ref.logprobs, rtol=0, atol=FP32_ATOL)
        assert out["logprob_token_ids"][index] == ref.topk(3)[0].tolist()
    assert metric_value(server, "proctor:prompt_reuse_misses_total") - misses == 2
    assert metric_value(server, "proctor:prompt_reuse_hits_total") - hits == len(arrivals) - 2
    # Measured by the engines: a member after its group's first ran positions P-1..T-2 only (T - P).
    expected = sum(len(s) for s in sequences) - sum(m.prompt_length for g in groups for m in g[1:])
    assert metric_value(server, "proctor:engine_computed_tokens_total") - computed == expected
