"""A request's ids keep one form from the wire to the engine: numpy int32 (`engines.base`).

Validation makes it once (token_ids: one copy out of the message's repeated field; score_ids: a
view of the message's bytes, no copy, no widening) and `EngineRequest` keeps those very arrays.
Through a real replica worker (the front's process → the worker's socket → the torch engine in
its own process) the engine is handed the same form, as views of the frame it was read into;
it answers the float64 reference exactly, so the form is what the engine scores from.
"""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import pytest
import torch

from proctor.proto import decode_tensor, encode_tensor, scoring_pb2, scoring_pb2_grpc
from proctor.server.engines.base import EngineSpec
from proctor.server.front.validation import validate

from support.form_probe import PROBE, build_form_reporting
from support.reference import reference_rows
from support.servers import start_worker_server

IDS = [3, 17, 250, 9, 41, 77, 5, 300]
FIRST_ROW = 3
SCORE_IDS = np.array([[1, 2, -1], [7, 8, 9], [4, -1, -1], [0, 5, 6], [11, 12, 13]], dtype=np.int32)
ONE_FORM = "numpy.ndarray int32 shape={} contiguous=True owndata=False"


@pytest.fixture(scope="module")
def worker_server(tiny_model_dir):
    """One replica whose worker process runs the torch engine that reports the form of its ids."""
    server = start_worker_server(EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=16), "form",
                                 build_form_reporting)
    yield server
    server.stop()


def _message(request_id: str) -> scoring_pb2.ScoreRequest:
    message = scoring_pb2.ScoreRequest(request_id=request_id, token_ids=IDS, prompt_length=FIRST_ROW, logprobs=True)
    message.score_ids.CopyFrom(encode_tensor(SCORE_IDS))
    return message


def test_validation_makes_the_form_once_and_the_request_keeps_it(worker_server):
    teacher = worker_server.server.service.router.teachers["form"]
    message = _message("in-process")
    request = validate(teacher, message, max_answer_bytes=None).request
    ids, score_ids = request.token_ids, request.score_ids
    assert type(ids) is np.ndarray and ids.dtype == np.int32 and ids.flags.c_contiguous and ids.tolist() == IDS
    # score_ids: the message's own bytes, viewed (not copied, not widened); read-only, as the wire is.
    assert type(score_ids) is np.ndarray and score_ids.dtype == np.int32 and np.array_equal(score_ids, SCORE_IDS)
    assert not score_ids.flags.owndata and not score_ids.flags.writeable
    again = type(request)(**{**request.__dict__})  # a rebuilt request keeps the very arrays
    assert again.token_ids is ids and again.score_ids is score_ids


def test_the_engine_in_a_worker_is_handed_the_one_form_on_both_transports(worker_server):
    expected = f"token_ids: {ONE_FORM.format([len(IDS)])} | {ONE_FORM.format(list(SCORE_IDS.shape))}"
    with grpc.insecure_channel(worker_server.grpc_target) as channel, pytest.raises(grpc.RpcError) as refused:
        scoring_pb2_grpc.TeacherScoringStub(channel).Score(_message(PROBE), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.value.details() == expected
    body = {"request_id": PROBE, "token_ids": IDS, "prompt_length": FIRST_ROW, "score_ids": SCORE_IDS.tolist()}
    reply = httpx.post(f"{worker_server.http_url}/v1/score", json=body, timeout=60)
    assert reply.status_code == 422 and reply.json()["error"]["message"] == expected


def test_what_the_engine_scores_from_that_form_is_the_reference(worker_server, tiny_model_dir):
    with grpc.insecure_channel(worker_server.grpc_target) as channel:
        answer = scoring_pb2_grpc.TeacherScoringStub(channel).Score(_message("scored"), timeout=60)
    ref = reference_rows(tiny_model_dir, IDS, FIRST_ROW)
    torch.testing.assert_close(decode_tensor(answer.logprobs).double(), ref.logprobs, rtol=0, atol=1e-5)
    wanted = torch.from_numpy(SCORE_IDS.astype(np.int64))
    picked = ref.distributions.gather(1, wanted.clamp_min(0)).masked_fill(wanted < 0, float("-inf"))
    torch.testing.assert_close(decode_tensor(answer.score_logprobs).double(), picked, rtol=0, atol=1e-5)
