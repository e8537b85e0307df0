"""The hostile callers of issue 34 and the normal client they must not hurt (tests and `bench/`).

Each attack is one call against a running server of the tiny teacher that knows the student
tokenizer `student` (bearer token given); each answers a 4xx or, for the socket flood, nothing.
`NORMAL_CALLS` are what an honest trainer sends meanwhile: plain and aligned, gRPC and HTTP.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx

from proctor.proto import scoring_pb2, scoring_pb2_grpc

PROMPT_IDS = [40, 41, 42, 43, 44, 45]
RESPONSE_IDS = [50, 51, 52, 53, 54, 55, 56, 57]


def aligned_body(*, messages: list[tuple[str, str]] | None = None, token_ids: list[int] | None = None,
                 **fields: Any) -> scoring_pb2.ScoreRequest:
    """An aligned request of the student `student`: its prompt and response ids, the teacher's
    prompt as `messages` (default: one short user turn)."""
    ids = token_ids if token_ids is not None else PROMPT_IDS + RESPONSE_IDS
    message = scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=len(PROMPT_IDS), logprobs=True, topk=4,
                                       student_tokenizer="student", **fields)
    for role, content in messages if messages is not None else [("user", "what is 12 times 7?")]:
        message.messages.add(role=role, content=content)
    return message


def attack_message(name: str) -> tuple[scoring_pb2.ScoreRequest, str]:
    """An oversized aligned request (issue 34's measurements) and the field its refusal names."""
    if name == "huge message":
        return aligned_body(messages=[("user", "x" * (30 << 20))]), "messages"
    if name == "many messages":
        return aligned_body(messages=[("user", "hi")] * 100_000), "messages"
    if name == "many student ids":
        return aligned_body(token_ids=[7] * 4_000_000), "token_ids"
    raise KeyError(name)


def http_json(message: scoring_pb2.ScoreRequest) -> dict:
    """The /v1/score JSON body of a ScoreRequest built here."""
    body: dict[str, Any] = {"token_ids": list(message.token_ids), "logprobs": message.logprobs}
    for name in ("topk", "student_tokenizer", "replica", "teacher_key"):
        if getattr(message, name):
            body[name] = getattr(message, name)
    if message.HasField("prompt_length"):
        body["prompt_length"] = message.prompt_length
    if message.messages:
        body["messages"] = [{"role": m.role, "content": m.content} for m in message.messages]
    return body


def _grpc(server, token: str, message: scoring_pb2.ScoreRequest, *, expect_ok: bool) -> None:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(server.grpc_target, options=options) as channel:
        try:
            scoring_pb2_grpc.TeacherScoringStub(channel).Score(
                message, metadata=(("authorization", f"Bearer {token}"),), timeout=60)
        except grpc.RpcError as error:
            if expect_ok or error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            return
    if not expect_ok:
        raise AssertionError("a hostile request was answered")


def _http(server, token: str, body: dict | bytes, *, path: str = "/v1/score", expect_ok: bool) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(server.http_url + path, content=content, timeout=60,
                       headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
    refused = 400 if path == "/v1/completions" else 422  # vLLM's error form there
    if (expect_ok and reply.status_code != 200) or (not expect_ok and reply.status_code != refused):
        raise AssertionError(f"{path}: {reply.status_code} {reply.text[:200]}")


def _socket_flood(server, token: str, count: int = 200) -> None:
    """`count` connections opened and left silent for a second."""
    host, port = server.http_url.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(count):
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                break
        time.sleep(1.0)
    finally:
        for sock in socks:
            sock.close()


def _edge_temperature(server, token: str) -> None:
    _http(server, token, {"token_ids": list(range(1, 40)), "topk": 4, "temperature": 1e300}, expect_ok=False)
    _http(server, token, {"prompt": list(range(1, 40)), "max_tokens": 1, "prompt_logprobs": 4,
                          "temperature": 1e-300}, path="/v1/completions", expect_ok=False)


def _ragged_score_ids(server, token: str) -> None:
    rows = [[1]] * 4000 + [list(range(4000))]
    _http(server, token, {"token_ids": list(range(1, 4003)), "prompt_length": 1, "score_ids": rows}, expect_ok=False)


def _huge_echo(server, token: str) -> None:
    _grpc(server, token, scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True, replica="r" * (100 << 10)),
          expect_ok=False)


# name -> one attack call (server, token)
ATTACKS: dict[str, Callable[[Any, str], None]] = {
    "aligned: 30 MiB message": lambda s, t: _grpc(s, t, attack_message("huge message")[0], expect_ok=False),
    "aligned: 100k messages": lambda s, t: _grpc(s, t, attack_message("many messages")[0], expect_ok=False),
    "aligned: 4M student ids": lambda s, t: _grpc(s, t, attack_message("many student ids")[0], expect_ok=False),
    "temperature at the float32 edge": _edge_temperature,
    "ragged score_ids": _ragged_score_ids,
    "100 KiB replica pin": _huge_echo,
    "200 silent sockets": _socket_flood,
}

# name -> one honest call (server, token); raises on any failure
NORMAL_CALLS: dict[str, Callable[[Any, str], None]] = {
    "grpc plain": lambda s, t: _grpc(s, t, scoring_pb2.ScoreRequest(token_ids=list(range(1, 65)), logprobs=True,
                                                                    topk=4), expect_ok=True),
    "http plain": lambda s, t: _http(s, t, {"token_ids": list(range(1, 65)), "topk": 4}, expect_ok=True),
    "grpc aligned": lambda s, t: _grpc(s, t, aligned_body(), expect_ok=True),
    "http aligned": lambda s, t: _http(s, t, http_json(aligned_body()), expect_ok=True),
}


def normal_client(server, token: str, seconds: float) -> tuple[list[float], list[str]]:
    """`NORMAL_CALLS` in turn for `seconds`: each call's latency, and each failure's description."""
    latencies: list[float] = []
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name, call in NORMAL_CALLS.items():
            started = time.perf_counter()
            try:
                call(server, token)
            except Exception as exc:
                failures.append(f"{name}: {exc!r}"[:300])
            latencies.append(time.perf_counter() - started)
    return latencies, failures


@dataclass(frozen=True)
class Target:
    """Where a server listens (what an attacker process needs of it)."""

    grpc_target: str
    http_url: str


def _attack_loop(target: Target, token: str, names: list[str], offset: int, seconds: float) -> int:
    deadline, index = time.monotonic() + seconds, offset
    while time.monotonic() < deadline:
        ATTACKS[names[index % len(names)]](target, token)
        index += 1
    return index - offset


def attackers(server, token: str, names: list[str], *, processes: int, seconds: float) -> Any:
    """`processes` processes, each sending the attacks `names` in turn for `seconds` (their own
    processes: building a 30 MiB request must not take the GIL of a server run in this one).
    An AsyncResult of each one's count of attacks sent; any attack answered wrongly raises there."""
    pool = multiprocessing.get_context("spawn").Pool(processes)
    target = Target(server.grpc_target, server.http_url)
    results = [pool.apply_async(_attack_loop, (target, token, names, i * 3, seconds)) for i in range(processes)]
    pool.close()
    return pool, results
