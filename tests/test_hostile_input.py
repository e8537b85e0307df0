"""Hostile or odd input on the real wire: every case is a 4xx naming the field (413 for size),
never a 500 / UNKNOWN / INTERNAL, and the server keeps serving afterwards."""

from __future__ import annotations

import io
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from proctor.client import RetryPolicy, TeacherClient
from proctor.client.transports import PayloadTooLarge
from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.server.common.errors import Code

from support.drain import start_drain_server
from support.servers import poll_live_while

TOKEN = "hostile-token"
LIMIT = 1 << 20
GOOD = {"token_ids": [1, 2, 3, 4], "logprobs": True}
SCORE = "/proctor.v1.TeacherScoring/Score"
SCORE_STREAM = "/proctor.v1.TeacherScoring/ScoreStream"


@pytest.fixture(scope="module")
def stub(torch_server):
    channel = grpc.insecure_channel(torch_server.grpc_target)
    yield scoring_pb2_grpc.TeacherScoringStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def limited(tiny_model_dir):
    """A server with a bearer token and a 1 MiB message limit (size and auth cases)."""
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir))
    options = ServerOptions(grpc_port=0, http_port=0, auth_token=TOKEN, max_message_bytes=LIMIT)
    with ServerThread(single_teacher_router(spec, name="tiny"), options) as server:
        yield server


def _assert_still_serving(server, headers: dict | None = None) -> None:
    metadata = tuple((headers or {}).items()) or None
    with grpc.insecure_channel(server.grpc_target) as channel:
        reply = scoring_pb2_grpc.TeacherScoringStub(channel).Score(
            scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True), metadata=metadata, timeout=30
        )
    assert reply.num_tokens == 3
    assert httpx.post(server.http_url + "/v1/score", json=GOOD, headers=headers, timeout=30).status_code == 200


def _assert_422(reply: httpx.Response, field: str) -> None:
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT" and error["field"] == field and field in error["message"]


def _nested(opening: str, closing: str, depth: int) -> str:
    return opening * depth + "1" + closing * depth


# (case, raw JSON body, field the 422 names)
HOSTILE_JSON = [
    ("topk 2**40", b'{"token_ids": [1, 2, 3], "topk": 1099511627776}', "topk"),
    ("prompt_length below int32", b'{"token_ids": [1, 2, 3], "prompt_length": -2147483649}', "prompt_length"),
    ("lone surrogate in request_id", b'{"token_ids": [1, 2, 3], "request_id": "\\ud800"}', "request_id"),
    ("lone surrogate in a key", b'{"token_ids": [1, 2, 3], "\\udfff": 1}', "\\udfff"),
    ("10k-level nesting", _nested("[", "]", 10_000).encode(), "body"),
    ("5000-digit integer", b'{"token_ids": [1, 2, 3], "topk": ' + b"7" * 5000 + b"}", "body"),
    ("deep mm_processor_kwargs object",
     b'{"token_ids": [1, 2, 3], "mm_processor_kwargs": ' + _nested('{"a":', "}", 10_000).encode() + b"}", "body"),
    ("deep mm_processor_kwargs text",
     json.dumps({"token_ids": [1, 2, 3], "mm_processor_kwargs": _nested('{"a":', "}", 10_000)}).encode(),
     "mm_processor_kwargs"),
    ("huge integer in mm_processor_kwargs text",
     json.dumps({"token_ids": [1, 2, 3], "mm_processor_kwargs": '{"a": ' + "9" * 5000 + "}"}).encode(),
     "mm_processor_kwargs"),
    ("non-ASCII base64", '{"token_ids": [1, 2], "images": [{"data": "é", "media_type": "image/png"}]}'.encode(),
     "images[0].data"),
    ("NaN", b'{"token_ids": [1, 2, 3], "topk": NaN}', "body"),
]


@pytest.mark.parametrize(("case", "content", "field"), HOSTILE_JSON, ids=[c[0] for c in HOSTILE_JSON])
def test_hostile_json_is_422_naming_the_field(torch_server, case, content, field):
    reply = httpx.post(torch_server.http_url + "/v1/score", content=content,
                       headers={"content-type": "application/json"}, timeout=30)
    _assert_422(reply, field)
    _assert_still_serving(torch_server)


def test_grpc_deep_mm_processor_kwargs_is_invalid_argument(torch_server, stub):
    request = scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True,
                                       mm_processor_kwargs=_nested('{"a":', "}", 10_000))
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mm_processor_kwargs" in info.value.details()
    _assert_still_serving(torch_server)


def _invalid_utf8_request() -> bytes:
    marked = scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True, request_id="~").SerializeToString()
    return marked.replace(b"~", b"\xff")


@pytest.mark.parametrize("raw", [b"\xff\xff\xff\xff\x0f", _invalid_utf8_request()], ids=["truncated", "invalid utf-8"])
def test_undecodable_grpc_bytes_are_invalid_argument(torch_server, raw):
    with grpc.insecure_channel(torch_server.grpc_target) as channel:
        unary = channel.unary_unary(SCORE, request_serializer=None, response_deserializer=None)
        streaming = channel.unary_stream(SCORE_STREAM, request_serializer=None, response_deserializer=None)
        for call in (lambda: unary(raw, timeout=30), lambda: list(streaming(raw, timeout=30))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("body: ")
    _assert_still_serving(torch_server)


def _http_status(sock: socket.socket) -> int:
    reply = b""
    while b"\r\n" not in reply:
        data = sock.recv(4096)
        assert data, "connection closed without an answer"
        reply += data
    return int(reply.split(b" ", 2)[1])


def test_chunked_body_is_refused_as_soon_as_it_passes_the_limit(limited):
    """The body never ends (no final chunk): only a limit enforced while reading can answer."""
    host, port = limited.http_url.removeprefix("http://").split(":")
    chunk = b"7" * (64 << 10)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/score HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        for _ in range(LIMIT // len(chunk) + 1):
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        assert _http_status(sock) == 413
    _assert_still_serving(limited, {"authorization": f"Bearer {TOKEN}"})


def test_large_json_body_does_not_stall_other_requests(torch_server):
    """A ~10 MB JSON body (3.5M token ids) is read and checked off the event loop: probes answered
    meanwhile stay fast, where an on-loop parse would hold them for the whole decode. Its ids are
    counted before any parse and are more than any teacher here scores: refused naming the body."""
    body = b'{"token_ids": [' + b"1, " * 3_500_000 + b'1], "logprobs": true}'
    latencies, took, reply = poll_live_while(torch_server.http_url, lambda: httpx.post(
        torch_server.http_url + "/v1/score", content=body, headers={"content-type": "application/json"}, timeout=60),
        interval=0.005)
    _assert_422(reply, "body")  # more numbers than a request of max_model_len tokens holds
    assert "holds more than" in reply.text
    assert len(latencies) > 5
    assert max(latencies) < max(0.25, took / 4), (max(latencies), took)
    _assert_still_serving(torch_server)


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer  "])
def test_bearer_scheme_is_case_insensitive(limited, scheme):
    headers = {"authorization": f"{scheme} {TOKEN}"}
    _assert_still_serving(limited, headers)  # both transports accept it
    refused = httpx.post(limited.http_url + "/v1/score", json=GOOD, headers={"authorization": f"{scheme} wrong"})
    assert refused.status_code == 401
    with grpc.insecure_channel(limited.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        scoring_pb2_grpc.TeacherScoringStub(channel).Score(
            scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True),
            metadata=(("authorization", f"{scheme} wrong"),), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_payload_too_large_is_never_retried(limited, transport):
    assert Code.PAYLOAD_TOO_LARGE.grpc_status is grpc.StatusCode.INVALID_ARGUMENT
    target = f"grpc://{limited.grpc_target}" if transport == "grpc" else limited.http_url
    too_many = [300] * (LIMIT // 2 + 1)  # two-byte varints: just past the limit
    async with TeacherClient(target, token=TOKEN, retry=RetryPolicy(max_attempts=5, initial_backoff_s=0.01)) as client:
        with pytest.raises(PayloadTooLarge) as caught:
            await client.score(too_many, timeout=30)
        assert caught.value.field == "body" and client.retries == 0
        assert (await client.score([1, 2, 3], timeout=30)).num_tokens == 3


BILLION_LAUGHS = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n" for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_yaml_alias_bomb_and_deep_documents_are_refused(tmp_path):
    from proctor.server.config import check_config_command

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BILLION_LAUGHS)
    checked = subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "check-config", str(bomb)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 1 and "aliases are expanded" in checked.stdout, checked.stdout + checked.stderr
    deep = tmp_path / "deep.yaml"
    deep.write_text(_nested("[", "]", 10_000))
    out = io.StringIO()
    assert check_config_command(deep, out=out) == 1
    assert "nested deeper than" in out.getvalue()


def test_keep_alive_answers_do_not_wait_for_delayed_acks(torch_server):
    """With Nagle's algorithm on (no TCP_NODELAY), each keep-alive answer written as headers
    then body waits ~40 ms for the client's delayed ACK."""
    with httpx.Client(base_url=torch_server.http_url, timeout=30) as client:
        client.get("/health/live")
        timings = []
        for _ in range(30):
            started = time.perf_counter()
            assert client.get("/health/live").status_code == 200
            timings.append(time.perf_counter() - started)
    assert statistics.median(timings) < 0.02, timings


def test_sigterm_drains_http_with_503_for_new_requests_and_exits_zero(tiny_model_dir):
    proc, grpc_target, url = start_drain_server(tiny_model_dir, delay=1.0, grace=20)
    try:
        with ThreadPoolExecutor(4) as pool:
            admitted = [pool.submit(httpx.post, url + "/v1/score", json={**GOOD, "request_id": f"h{i}"}, timeout=30)
                        for i in range(4)]
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            late = httpx.post(url + "/v1/score", json=GOOD, timeout=10)  # a new connection, during the drain
            assert late.status_code == 503 and late.json()["error"]["code"] == "UNAVAILABLE"
            assert int(late.headers["retry-after"]) >= 1
            with grpc.insecure_channel(grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
                scoring_pb2_grpc.TeacherScoringStub(channel).Score(
                    scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert float(dict(info.value.trailing_metadata())["retry-after"]) > 0
            replies = [future.result() for future in admitted]
        assert [r.status_code for r in replies] == [200] * 4
        assert sorted(r.json()["request_id"] for r in replies) == [f"h{i}" for i in range(4)]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
