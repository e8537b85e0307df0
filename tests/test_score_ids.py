"""score_ids through the real servers, both engines: the teacher's log-probs at ids the caller
chose (the student's top-k), equal to the full log-softmax of an independent transformers
forward at those ids; padding, ragged JSON rows, prompt_length, streams; bad score_ids refused
naming the field while the server keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import numpy as np
import pytest
import torch

from proctor.client import TeacherClient
from proctor.proto import scoring_pb2, scoring_pb2_grpc

from support.reference import reference_rows

VOCAB = 512
# The bar of the issue: fp32 agreement with the reference's full log-softmax.
ATOL = 1e-5
SEQUENCE = [3, 17, 250, 9, 41, 7, 500, 12, 88, 5, 301, 64]


def _student_like_ids(rows: int, k: int, seed: int) -> torch.Tensor:
    """[rows, k] distinct ids per row with some -1 padding at the ends of rows (as ragged top-p supports)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:k] for _ in range(rows)]).to(torch.int32)
    for row in range(0, rows, 3):
        ids[row, k - 1 - row % k :] = -1
    ids[:, 0] = ids[:, 0].clamp_min(0)  # every row scores at least one id
    return ids


def _expected(model_dir, tokens: list[int], first_row: int, ids: torch.Tensor) -> torch.Tensor:
    """The reference's full log-softmax at ids (float64), -inf at padding."""
    dist = reference_rows(model_dir, tokens, first_row).distributions
    picked = dist.gather(1, ids.long().clamp_min(0))
    return picked.masked_fill(ids < 0, float("-inf"))


def _assert_scores(actual: torch.Tensor, expected: torch.Tensor) -> None:
    pad = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual) & (actual < 0), pad), "padding must be exactly -inf"
    torch.testing.assert_close(actual.double()[~pad], expected[~pad], rtol=0, atol=ATOL)


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("prompt_length", [None, 5])
def test_score_ids_equal_the_teachers_full_log_softmax(scoring_server, transport, prompt_length):
    first_row = prompt_length or 1
    ids = _student_like_ids(len(SEQUENCE) - first_row, 8, seed=first_row)
    target = scoring_server.grpc_target if transport == "grpc" else scoring_server.http_url

    async def go():
        async with TeacherClient(target) as client:
            return await client.score(SEQUENCE, prompt_length=prompt_length, logprobs=True, topk=4, score_ids=ids)

    scores = asyncio.run(go())
    assert scores.first_row == first_row and scores.score_logprobs.shape == ids.shape
    assert scores.score_logprobs.dtype == torch.float32
    _assert_scores(scores.score_logprobs, _expected(scoring_server.model_dir, SEQUENCE, first_row, ids))
    # The other outputs of the same request are unchanged by score_ids.
    reference = reference_rows(scoring_server.model_dir, SEQUENCE, first_row)
    torch.testing.assert_close(scores.logprobs.double(), reference.logprobs, rtol=0, atol=scoring_server.atol)


def test_score_ids_alone_and_in_a_stream(scoring_server):
    ids = _student_like_ids(len(SEQUENCE) - 2, 5, seed=3)
    expected = _expected(scoring_server.model_dir, SEQUENCE, 2, ids)

    async def go():
        async with TeacherClient(scoring_server.grpc_target) as client:
            alone = await client.score(SEQUENCE, prompt_length=2, logprobs=False, score_ids=ids)
            streamed = await client.score(SEQUENCE, prompt_length=2, hidden_states=True, score_ids=ids.tolist())
            return alone, streamed

    alone, streamed = asyncio.run(go())
    assert alone.logprobs is None and alone.topk_ids is None
    _assert_scores(alone.score_logprobs, expected)
    assert streamed.hidden_states is not None
    _assert_scores(streamed.score_logprobs, expected)


def test_json_score_ids_take_ragged_rows_and_answer_all_rows(scoring_server):
    first_row = 4
    rows = [[1, 2, 3], [7], [], [300, 12, 511, 0]] + [[5, 6]] * (len(SEQUENCE) - first_row - 4)
    body = {"token_ids": SEQUENCE, "prompt_length": first_row, "logprobs": False, "score_ids": rows}
    reply = httpx.post(scoring_server.http_url + "/v1/score", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()["score_logprobs"]
    assert len(answer) == len(SEQUENCE) and answer[:first_row] == [None] * first_row
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)
    expected = _expected(scoring_server.model_dir, SEQUENCE, first_row, ids)
    for got, want, row in zip(answer[first_row:], expected, rows, strict=True):
        assert len(got) == width
        assert got[len(row):] == [None] * (width - len(row)), "padding is null in JSON"
        if row:
            torch.testing.assert_close(torch.tensor(got[: len(row)], dtype=torch.float64), want[: len(row)],
                                       rtol=0, atol=ATOL)


def test_list_teachers_states_score_ids_and_the_method(scoring_server):
    async def go():
        async with TeacherClient(scoring_server.grpc_target) as client:
            return await client.teachers()

    (info,) = (asyncio.run(go())).values()
    assert "score_ids" in info.outputs
    expected = {"torch": {"log_softmax"}, "vllm": {"pooler"}}
    assert info.score_ids_method in expected[scoring_server.engine]


def _wire(ids: np.ndarray, dtype: int = scoring_pb2.INT32) -> scoring_pb2.Tensor:
    return scoring_pb2.Tensor(dtype=dtype, shape=list(ids.shape), data=ids.tobytes())


GOOD_ROWS = np.zeros((3, 2), dtype="<i4")  # for [1, 2, 3, 4]: rows 1..3
# (case, score_ids on the wire, the same as JSON or None where JSON cannot say it)
BAD = [
    ("wrong row count", _wire(np.zeros((2, 2), dtype="<i4")), [[0, 1], [2, 3]]),
    ("id at vocab", _wire(np.array([[0, 1], [2, VOCAB], [4, 5]], dtype="<i4")), [[0, 1], [2, VOCAB], [4, 5]]),
    ("id below padding", _wire(np.array([[0, -2], [2, 3], [4, 5]], dtype="<i4")), [[0, -2], [2, 3], [4, 5]]),
    ("k too large", _wire(np.zeros((3, 65), dtype="<i4")), [[0] * 65] * 3),
    ("empty rows", _wire(np.zeros((3, 0), dtype="<i4")), [[], [], []]),
    ("wrong dtype", _wire(GOOD_ROWS.astype("<f4"), scoring_pb2.FLOAT32), [[0.5, 1], [2, 3], [4, 5]]),
    ("int64", _wire(GOOD_ROWS.astype("<i8"), scoring_pb2.INT64), None),
    ("1-D", _wire(np.zeros(3, dtype="<i4")), [0, 1, 2]),
    ("short data", scoring_pb2.Tensor(dtype=scoring_pb2.INT32, shape=[3, 2], data=b"\0" * 20), None),
]


@pytest.fixture(scope="module")
def stub(scoring_server):
    channel = grpc.insecure_channel(scoring_server.grpc_target)
    yield scoring_pb2_grpc.TeacherScoringStub(channel)
    channel.close()


def _still_serving(stub, url: str) -> None:
    good = scoring_pb2.ScoreRequest(token_ids=[1, 2, 3, 4], logprobs=False, score_ids=_wire(GOOD_ROWS))
    assert stub.Score(good).score_logprobs.shape == [3, 2]
    reply = httpx.post(url + "/v1/score", json={"token_ids": [1, 2, 3, 4], "score_ids": GOOD_ROWS.tolist()})
    assert reply.status_code == 200


@pytest.mark.parametrize(("case", "wire", "as_json"), BAD, ids=[c[0] for c in BAD])
def test_bad_score_ids_are_invalid_argument_naming_the_field(scoring_server, stub, case, wire, as_json):
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(scoring_pb2.ScoreRequest(token_ids=[1, 2, 3, 4], logprobs=True, score_ids=wire))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "score_ids" in info.value.details()
    if as_json is not None:
        body = {"token_ids": [1, 2, 3, 4], "score_ids": as_json}
        reply = httpx.post(scoring_server.http_url + "/v1/score", json=body, timeout=30)
        assert reply.status_code == 422
        error = reply.json()["error"]
        assert error["field"] == "score_ids" and "score_ids" in error["message"]
    _still_serving(stub, scoring_server.http_url)
