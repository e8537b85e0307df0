"""Bad input gets the documented status and a message naming the field; the server keeps serving."""

from __future__ import annotations

import grpc
import httpx
import pytest

from proctor.proto import scoring_pb2, scoring_pb2_grpc

GOOD = {"token_ids": [1, 2, 3, 4], "logprobs": True}

# (case, JSON body, gRPC code, HTTP status, field named in the message)
CASES = [
    ("id above vocab", {"token_ids": [1, 2, 512], "logprobs": True}, grpc.StatusCode.INVALID_ARGUMENT, 422, "token_ids"),
    ("negative id", {"token_ids": [1, -3, 2], "logprobs": True}, grpc.StatusCode.INVALID_ARGUMENT, 422, "token_ids"),
    ("empty ids", {"token_ids": [], "logprobs": True}, grpc.StatusCode.INVALID_ARGUMENT, 422, "token_ids"),
    ("over length", {"token_ids": [1] * 5000, "logprobs": True}, grpc.StatusCode.INVALID_ARGUMENT, 422, "token_ids"),
    ("unknown teacher", {**GOOD, "teacher_key": "nope"}, grpc.StatusCode.NOT_FOUND, 404, "teacher_key"),
    ("k above limit", {**GOOD, "topk": 65}, grpc.StatusCode.INVALID_ARGUMENT, 422, "topk"),
    ("negative k", {**GOOD, "topk": -1}, grpc.StatusCode.INVALID_ARGUMENT, 422, "topk"),
    ("prompt length past end", {**GOOD, "prompt_length": 4}, grpc.StatusCode.INVALID_ARGUMENT, 422, "prompt_length"),
    ("prompt length zero", {**GOOD, "prompt_length": 0}, grpc.StatusCode.INVALID_ARGUMENT, 422, "prompt_length"),
    ("nothing asked", {"token_ids": [1, 2, 3], "logprobs": False}, grpc.StatusCode.INVALID_ARGUMENT, 422, "logprobs"),
    ("media to a text-only teacher", None, grpc.StatusCode.INVALID_ARGUMENT, 422, "images"),
]


def _request(body: dict | None) -> scoring_pb2.ScoreRequest:
    if body is None:
        return scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True,
                                        images=[scoring_pb2.Media(data=b"\x89PNG", media_type="image/png")])
    request = scoring_pb2.ScoreRequest(token_ids=body["token_ids"], logprobs=body.get("logprobs", False),
                                       topk=body.get("topk", 0), teacher_key=body.get("teacher_key", ""))
    if "prompt_length" in body:
        request.prompt_length = body["prompt_length"]
    return request


@pytest.fixture(scope="module")
def stub(scoring_server):
    channel = grpc.insecure_channel(scoring_server.grpc_target)
    yield scoring_pb2_grpc.TeacherScoringStub(channel)
    channel.close()


def _assert_still_serving(stub, url):
    assert stub.Score(scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True)).num_tokens == 3
    assert httpx.post(url + "/v1/score", json=GOOD).status_code == 200


@pytest.mark.parametrize(("case", "body", "code", "status", "field"), CASES, ids=[c[0] for c in CASES])
def test_grpc_bad_input_names_the_field(scoring_server, stub, case, body, code, status, field):
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(_request(body))
    assert info.value.code() == code
    assert field in info.value.details()
    _assert_still_serving(stub, scoring_server.http_url)


@pytest.mark.parametrize(("case", "body", "code", "status", "field"), CASES, ids=[c[0] for c in CASES])
def test_http_bad_input_names_the_field(scoring_server, stub, case, body, code, status, field):
    if body is None:
        body = {"token_ids": [1, 2, 3], "images": [{"data": "iVBORw==", "media_type": "image/png"}]}
    reply = httpx.post(scoring_server.http_url + "/v1/score", json=body, timeout=30)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["field"] == field and field in error["message"]
    _assert_still_serving(stub, scoring_server.http_url)


@pytest.mark.parametrize(
    ("content", "content_type", "field"),
    [
        (b'{"token_ids": [1, 2,', "application/json", "body"),
        (b'[1, 2, 3]', "application/json", "body"),
        (b'{"token_ids": "abc"}', "application/json", "token_ids"),
        (b'{"token_ids": [1, 2], "topk": "5"}', "application/json", "topk"),
        (b'{"token_ids": [1, 2], "colour": 1}', "application/json", "colour"),
        (b"\xff\xff\xff\xff\x0f", "application/x-protobuf", "body"),
        (b"abc", "text/plain", "content-type"),
    ],
    ids=["truncated json", "not an object", "ids not a list", "k not int", "unknown field", "bad protobuf", "bad content type"],
)
def test_http_malformed_bodies_get_422(scoring_server, stub, content, content_type, field):
    reply = httpx.post(scoring_server.http_url + "/v1/score", content=content, headers={"content-type": content_type})
    assert reply.status_code == 422
    assert reply.json()["error"]["field"] == field
    _assert_still_serving(stub, scoring_server.http_url)


def test_oversized_messages_are_refused(scoring_server, stub):
    huge = [1 << 30] * (14 << 20)  # 14M five-byte varints: past the 64 MiB message limit
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(scoring_pb2.ScoreRequest(token_ids=huge, logprobs=True))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    reply = httpx.post(scoring_server.http_url + "/v1/score", content=b"0" * (65 << 20),
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 413 and reply.json()["error"]["field"] == "body"
    _assert_still_serving(stub, scoring_server.http_url)
