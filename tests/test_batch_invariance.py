"""`inference.batch_invariant`: a sequence's scores do not depend on its batch or its replica.

The torch engine (real, on the tiny teacher) scores 16 sequences alone, then inside one batch of 32
of mixed lengths (the 16 at shuffled positions between 16 others, with prompt lengths, top-k and
hidden states), and a two-replica server (each replica a worker process of its own) scores them on
each replica, pinned: log-probs, top-k and hidden states are bit-identical everywhere. Without the
flag the same batch of 32 changes some sequence's scores (the padded pass: the difference the flag
removes), within float32 rounding of the float64 reference either way.
"""

from __future__ import annotations

import random
import subprocess
import sys

import grpc
import httpx
import pytest
import torch

from proctor.proto import decode_tensor, scoring_pb2, scoring_pb2_grpc
from proctor.server.engines.base import EngineRequest, EngineSpec
from proctor.server.engines.factory import create_engine

from support.reference import reference_rows
from support.routers import replica_router
from support.scoring import sequences
from support.servers import start_server

TOPK = 5
PROBES = sequences(16, seed=27, length=(8, 160))  # the 16 sequences checked
OTHERS = sequences(16, seed=28, length=(6, 200))  # their batch-mates (mixed lengths)


def _request(index: int, ids: list[int]) -> EngineRequest:
    return EngineRequest(request_id=f"s{index}", token_ids=torch.tensor(ids), first_row=1 + index % 4,
                         logprobs=True, topk=TOPK, hidden_states=True)


async def _scores(engine, batch: list[EngineRequest]) -> dict[str, object]:
    return {r.request_id: result for r, result in zip(batch, await engine.score(batch), strict=True)}


async def _alone_and_in_a_batch_of_32(engine) -> tuple[dict, dict]:
    alone = {}
    for i, ids in enumerate(PROBES):
        alone.update(await _scores(engine, [_request(i, ids)]))
    batch = [_request(i, ids) for i, ids in enumerate(PROBES)] + [_request(100 + i, ids) for i, ids in enumerate(OTHERS)]
    random.Random(5).shuffle(batch)
    return alone, await _scores(engine, batch)


def _identical(a, b) -> bool:
    return all(torch.equal(getattr(a, name), getattr(b, name))
               for name in ("logprobs", "topk_ids", "topk_logprobs", "hidden_states"))


@pytest.fixture(scope="module")
async def invariant_scores(tiny_model_dir):
    engine = create_engine(EngineSpec("torch", str(tiny_model_dir), inference={"batch_invariant": True}))
    await engine.start()
    try:
        yield engine, *(await _alone_and_in_a_batch_of_32(engine))
    finally:
        await engine.close()


@pytest.fixture(scope="module")
async def padded_scores(tiny_model_dir):
    engine = create_engine(EngineSpec("torch", str(tiny_model_dir)))
    await engine.start()
    try:
        yield await _alone_and_in_a_batch_of_32(engine)
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def two_replicas(tiny_model_dir):
    spec = EngineSpec("torch", str(tiny_model_dir), max_topk=8, inference={"batch_invariant": True})
    server = start_server(replica_router("inv", [spec, spec], health_check_interval_s=None))
    yield server
    server.stop()


def _pinned(server, ids: list[int], first_row: int, replica: str) -> scoring_pb2.ScoreResponse:
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))
    return stub.Score(scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=first_row, logprobs=True, topk=TOPK,
                                               hidden_states=True, replica=replica), timeout=60)


def test_sixteen_sequences_alone_and_in_a_batch_of_32_are_bit_identical(invariant_scores):
    _, alone, batched = invariant_scores
    assert len(batched) == 32
    for name, result in alone.items():
        assert _identical(result, batched[name]), name


def test_without_the_flag_the_padded_batch_of_32_changes_some_sequence(padded_scores):
    alone, batched = padded_scores
    differing = [name for name, result in alone.items() if not _identical(result, batched[name])]
    assert differing, "the padded pass gave every sequence its lone scores: the test shows nothing"
    worst = max(float((alone[n].logprobs - batched[n].logprobs).abs().max()) for n in differing)
    assert 0 < worst < 1e-4  # float rounding: the batch, not a bug, moved the scores


def test_batch_invariant_scores_equal_the_float64_reference(invariant_scores, tiny_model_dir):
    _, alone, _ = invariant_scores
    for i, ids in enumerate(PROBES):
        result, ref = alone[f"s{i}"], reference_rows(tiny_model_dir, ids, 1 + i % 4, dtype=torch.float64)
        torch.testing.assert_close(result.logprobs.double(), ref.logprobs, rtol=0, atol=1e-5)
        ref_ids, ref_values = ref.topk(TOPK)
        assert torch.equal(result.topk_ids.long(), ref_ids)
        torch.testing.assert_close(result.topk_logprobs.double(), ref_values, rtol=0, atol=1e-5)
        torch.testing.assert_close(result.hidden_states.float(), ref.hidden_states.float(), rtol=0, atol=1e-4)


def test_a_batch_invariant_teacher_turns_prompt_reuse_off_and_says_so(invariant_scores):
    engine, _, _ = invariant_scores
    assert engine.describe().batch_invariant and engine._prefix is None
    assert engine.spec.inference["prompt_reuse"] is False


def test_the_other_replica_answers_bit_identically(two_replicas, invariant_scores):
    _, alone, _ = invariant_scores
    for i, ids in enumerate(PROBES):
        lone = alone[f"s{i}"]
        for replica in ("inv-0", "inv-1"):
            answer = _pinned(two_replicas, ids, 1 + i % 4, replica)
            for name in ("logprobs", "topk_ids", "topk_logprobs", "hidden_states"):
                assert torch.equal(decode_tensor(getattr(answer, name)), getattr(lone, name).to(
                    decode_tensor(getattr(answer, name)).dtype)), (replica, i, name)


def test_list_teachers_says_the_teacher_is_batch_invariant(two_replicas):
    teachers = httpx.get(f"{two_replicas.http_url}/v1/teachers").json()["teachers"]
    (teacher,) = teachers
    assert teacher["batch_invariant"] is True
    assert [r["replica_id"] for r in teacher["replicas"]] == ["inv-0", "inv-1"]


def test_an_unknown_replica_is_invalid_argument_naming_the_field(two_replicas):
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(two_replicas.grpc_target))
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True, replica="inv-7"), timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "replica" in err.value.details() and "inv-0, inv-1" in err.value.details()
    response = httpx.post(f"{two_replicas.http_url}/v1/score", json={"token_ids": [1, 2, 3], "replica": "nope"})
    assert response.status_code == 422 and response.json()["error"]["field"] == "replica"


def test_a_pinned_request_is_scored_by_that_replica_alone(two_replicas):
    teacher = two_replicas.server.service.router.teachers["inv"]
    before = [r.served for r in teacher.replicas]
    for _ in range(3):
        _pinned(two_replicas, PROBES[0], 1, "inv-1")
    assert [r.served - b for r, b in zip(teacher.replicas, before, strict=True)] == [0, 3]


def test_proctor_verify_prints_the_table_and_exits_0(two_replicas):
    done = subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "verify", "--target",
                           f"grpc://{two_replicas.grpc_target}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "teacher inv (torch, batch-invariant)" in done.stdout and "threshold 0" in done.stdout
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.startswith("inv-")}
    assert rows == {"inv-0": ["0", "0", "0"], "inv-1": ["0", "0", "0"]}
