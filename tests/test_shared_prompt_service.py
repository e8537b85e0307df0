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
from proctor.server.config import single_teacher_router
from proctor.server.engines.base import EngineSpec

from support.groups import FP32_ATOL, interleaved, make_groups
from support.reference import reference_rows
from support.servers import metric_value, start_server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir), dtype="float32", max_topk=8,
                      inference={"prompt_reuse_min_tokens": 16})
    server = start_server(single_teacher_router(spec, name="tiny", replicas=2, health_check_interval_s=None))
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
