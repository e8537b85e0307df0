"""HTTP transport (httpx): protobuf bodies on `POST /v1/score`, for networks that only pass HTTP.

Bodies are the same `ScoreRequest` / `ScoreResponse` messages as gRPC
(`application/x-protobuf`), so both transports decode identical bytes. The deadline travels
in `x-request-timeout`; a cancelled call closes its connection, which the server notices and
withdraws the request. Streams (`POST /v1/score/stream`, `GET /v1/unembedding`) are
length-delimited `ScoreChunk` / `TensorChunk` messages, read back into the very messages the
gRPC transport yields.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from proctor.client.transports import PAYLOAD_TOO_LARGE, TeacherError, Transport, make_error
from proctor.proto import scoring_pb2
from proctor.proto.framing import read_frames
from proctor.proto.wire import (
    PROTOBUF_MEDIA_TYPE,
    RETRY_AFTER_HEADER,
    RETRY_AFTER_MS_HEADER,
    TIMEOUT_HEADER,
    status_of_http,
)

# Extra time the client waits past the deadline it sent, so the server's own
# DEADLINE_EXCEEDED (with its message) normally arrives before the client gives up.
_DEADLINE_GRACE_S = 0.25
def _retry_hint(headers: httpx.Headers) -> float | None:
    for name, scale in ((RETRY_AFTER_MS_HEADER, 1000.0), (RETRY_AFTER_HEADER, 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return max(0.0, float(value) / scale)
            except ValueError:
                continue
    return None


def error_from_response(response: httpx.Response) -> TeacherError:
    code = status_of_http(response.status_code)  # 413 is PAYLOAD_TOO_LARGE: never retried
    message, field = response.text[:500] or response.reason_phrase, None
    try:
        error = response.json()["error"]
        message, field = error.get("message") or message, error.get("field")
        if code != PAYLOAD_TOO_LARGE:  # whatever the body claims, a 413 is final
            code = error.get("code") or code
    except (ValueError, KeyError, TypeError):
        pass
    return make_error(code, message, field=field, retry_after=_retry_hint(response.headers))


class HttpTransport(Transport):
    name = "http"

    def __init__(self, base_url: str, *, token: str | None = None, max_connections: int = 64,
                 verify: bool | str = True) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            verify=verify,
        )

    async def _send(self, method: str, path: str, *, timeout: float | None, **kwargs) -> httpx.Response:
        try:
            coro = self._client.request(method, path, **kwargs)
            if timeout is None:
                response = await coro
            else:
                response = await asyncio.wait_for(coro, timeout + _DEADLINE_GRACE_S)
        except TimeoutError:
            raise make_error("DEADLINE_EXCEEDED", f"no answer within the deadline ({timeout:.3f}s)") from None
        except httpx.TimeoutException as exc:
            raise make_error("DEADLINE_EXCEEDED", f"HTTP timeout: {exc!r}") from None
        except httpx.TransportError as exc:
            # Connection refused or dropped: the server is down or restarting. Scoring is
            # idempotent, so a retry cannot double-count anything.
            raise make_error("UNAVAILABLE", f"cannot reach {self._client.base_url}: {exc!r}") from None
        if response.status_code != 200:
            raise error_from_response(response)
        return response

    async def score(self, request, timeout):
        headers = {"content-type": PROTOBUF_MEDIA_TYPE, "accept": PROTOBUF_MEDIA_TYPE}
        if timeout is not None:
            headers[TIMEOUT_HEADER] = f"{max(0.0, timeout):.3f}"
        response = await self._send("POST", "/v1/score", timeout=timeout, content=request.SerializeToString(),
                                    headers=headers)
        message = scoring_pb2.ScoreResponse()
        try:
            message.ParseFromString(response.content)
        except DecodeError as exc:
            raise make_error("INTERNAL", f"the server's answer is not a ScoreResponse ({exc})") from None
        return message

    async def _stream(self, method: str, path: str, message_type, *, timeout: float | None, **kwargs):
        """Frames of message_type from a streamed answer; errors before the body become TeacherErrors."""
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout + _DEADLINE_GRACE_S
        try:
            async with self._client.stream(method, path, **kwargs) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise error_from_response(response)
                async for message in read_frames(response.aiter_bytes(), message_type):
                    if deadline is not None and asyncio.get_running_loop().time() > deadline:
                        raise make_error("DEADLINE_EXCEEDED", f"stream not finished within the deadline ({timeout:.3f}s)")
                    yield message
        except httpx.TimeoutException as exc:
            raise make_error("DEADLINE_EXCEEDED", f"HTTP timeout: {exc!r}") from None
        except httpx.TransportError as exc:
            raise make_error("UNAVAILABLE", f"cannot reach {self._client.base_url}: {exc!r}") from None
        except (ValueError, DecodeError) as exc:
            raise make_error("INTERNAL", f"the server's stream is malformed ({exc})") from None

    async def score_stream(self, request, timeout) -> AsyncIterator[scoring_pb2.ScoreChunk]:
        headers = {"content-type": PROTOBUF_MEDIA_TYPE}
        if timeout is not None:
            headers[TIMEOUT_HEADER] = f"{max(0.0, timeout):.3f}"
        async for chunk in self._stream("POST", "/v1/score/stream", scoring_pb2.ScoreChunk, timeout=timeout,
                                        content=request.SerializeToString(), headers=headers):
            yield chunk

    async def list_teachers(self, timeout):
        response = await self._send("GET", "/v1/teachers", timeout=timeout)
        return json_format.ParseDict(response.json(), scoring_pb2.TeachersResponse(), ignore_unknown_fields=True)

    async def unembedding(self, teacher_key, timeout, *, projected=False) -> AsyncIterator[scoring_pb2.TensorChunk]:
        params = {"teacher_key": teacher_key or "", **({"projected": "true"} if projected else {})}
        async for chunk in self._stream("GET", "/v1/unembedding", scoring_pb2.TensorChunk, timeout=timeout,
                                        params=params):
            yield chunk

    async def close(self) -> None:
        await self._client.aclose()
