"""The HTTP shell (FastAPI): JSON for small requests, protobuf bodies for the same messages.

`POST /v1/score` takes `application/json` or `application/x-protobuf` and answers in the
request's format unless `Accept` asks for the other. Errors are `{"error": {"code",
"message", "field"}}` with the contract's status codes; 429/503 carry `Retry-After`.
A client that disconnects cancels its request, which then leaves the queue.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf.message import DecodeError
from starlette.requests import ClientDisconnect

from proctor.proto import scoring_pb2
from proctor.proto.framing import STREAM_MEDIA_TYPE, frame
from proctor.proto.wire import (
    JSON_MEDIA_TYPE,
    PROTOBUF_MEDIA_TYPE,
    RETRY_AFTER_HEADER,
    RETRY_AFTER_MS_HEADER,
    TIMEOUT_HEADER,
)
from proctor.server.errors import Code, ScoringError, invalid
from proctor.server.front.auth import TokenAuth
from proctor.server.front.bounded_json import loads_bounded
from proctor.server.front.openai_compat import mount_openai_compat
from proctor.server.front.responses import Responses
from proctor.server.front.service import ScoredRequest, ScoringService
from proctor.server.settings import ServerOptions

_JSON_FIELDS = {
    "request_id": str,
    "teacher_key": str,
    "token_ids": list,
    "prompt_length": int,
    "logprobs": bool,
    "topk": int,
    "hidden_states": bool,
    "images": list,
    "videos": list,
    "audios": list,
    "mm_processor_kwargs": (dict, str),
    "temperature": (int, float),
    "score_ids": list,
}


def error_response(error: ScoringError) -> JSONResponse:
    headers = {}
    if error.retry_after is not None:
        headers[RETRY_AFTER_HEADER] = str(max(1, round(error.retry_after)))
        headers[RETRY_AFTER_MS_HEADER] = str(int(error.retry_after * 1000))
    body = {"error": {"code": error.code.name, "message": error.message, "field": error.field}}
    return JSONResponse(body, status_code=error.code.http_status, headers=headers)


_INT32 = range(-(2**31), 2**31)
# JSON bodies above this size are decoded in a worker thread. bounded_json calls back into
# Python for every number, so that thread yields the GIL and the event loop (gRPC included)
# keeps serving while a large body is decoded; small bodies are not worth a thread hop.
INLINE_DECODE_BYTES = 256 << 10
# Token ids go into the protobuf in slices of this many, so no single C call holds the GIL long.
_IDS_SLICE = 1 << 16


def _media_from_json(items: list, field: str) -> list[scoring_pb2.Media]:
    out = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or "data" not in item or not isinstance(item.get("media_type"), str):
            raise invalid(f"{field}[{index}]", 'must be {"data": <base64>, "media_type": "..."}')
        try:
            data = base64.b64decode(item["data"], validate=True)
        except (ValueError, TypeError) as exc:  # binascii.Error is a ValueError, as is non-ASCII text
            raise invalid(f"{field}[{index}].data", "is not valid base64") from exc
        out.append(scoring_pb2.Media(data=data, media_type=item["media_type"]))
    return out


def _check_field(key: str, value: Any) -> None:
    """One top-level field's type (and, for integers, the int32 range of the wire)."""
    if key not in _JSON_FIELDS:
        raise invalid(key, f"unknown field (known: {', '.join(_JSON_FIELDS)})")
    expected = _JSON_FIELDS[key]
    if value is None:
        return
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(key, f"must be an integer, got {type(value).__name__}")
        if value not in _INT32:
            raise invalid(key, f"is {_short(value)}, outside the int32 range")
    elif not isinstance(value, expected):
        raise invalid(key, f"has the wrong type {type(value).__name__}")


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"an integer of {len(text)} digits"


def _token_ids(ids: list | None) -> list[int]:
    if ids is None:
        raise invalid("token_ids", "is required")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise invalid("token_ids", "must be a list of integers")
    if any(t not in _INT32 for t in ids):
        raise invalid("token_ids", "has a value outside the int32 range")
    return ids


# Padded score_ids a JSON body may expand to (ragged rows are padded to the longest): bounds the
# allocation before validation, which then holds K to the teacher's max_topk.
_MAX_SCORE_ID_CELLS = 1 << 24


def _score_ids(rows: list) -> scoring_pb2.Tensor:
    """score_ids as R lists of ids (ragged allowed) -> int32 [R, K] with -1 padding, the wire form."""
    if not all(isinstance(row, list) for row in rows):
        raise invalid("score_ids", "must be a list of rows, each a list of token ids")
    width = max((len(row) for row in rows), default=0)
    if len(rows) * width > _MAX_SCORE_ID_CELLS:
        raise invalid("score_ids", f"{len(rows)} rows of up to {width} ids are too many")
    if any(isinstance(t, bool) or not isinstance(t, int) or t not in _INT32 for row in rows for t in row):
        raise invalid("score_ids", "must hold integer token ids in the int32 range")
    ids = np.full((len(rows), width), -1, dtype="<i4")
    for index, row in enumerate(rows):
        ids[index, : len(row)] = row
    return scoring_pb2.Tensor(dtype=scoring_pb2.INT32, shape=[len(rows), width], data=ids.tobytes())


def _processor_kwargs(kwargs: dict | str) -> str:
    """mm_processor_kwargs as the JSON text the wire carries; a string is checked here with
    the same bounds as the body, so that hostile text never reaches the service's parser."""
    if isinstance(kwargs, dict):
        return json.dumps(kwargs)
    if not isinstance(loads_bounded(kwargs, field="mm_processor_kwargs"), dict):
        raise invalid("mm_processor_kwargs", "must be a JSON object")
    return kwargs


def request_from_json(body: Any) -> scoring_pb2.ScoreRequest:
    """Strictly typed JSON -> ScoreRequest; unknown, mistyped or out-of-range fields are named
    in the error. `body` should come from `loads_bounded`, which bounds depth and numbers."""
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    for key, value in body.items():
        _check_field(key, value)
    ids = _token_ids(body.get("token_ids"))
    request = scoring_pb2.ScoreRequest(
        request_id=body.get("request_id") or "",
        teacher_key=body.get("teacher_key") or "",
        logprobs=bool(body.get("logprobs", True)),
        topk=body.get("topk") or 0,
        hidden_states=bool(body.get("hidden_states", False)),
    )
    for start in range(0, len(ids), _IDS_SLICE):
        request.token_ids.extend(ids[start:start + _IDS_SLICE])
    if body.get("prompt_length") is not None:
        request.prompt_length = body["prompt_length"]
    for field in ("images", "videos", "audios"):
        if body.get(field):
            getattr(request, field).extend(_media_from_json(body[field], field))
    kwargs = body.get("mm_processor_kwargs")
    if kwargs:
        request.mm_processor_kwargs = _processor_kwargs(kwargs)
    if body.get("temperature") is not None:
        if isinstance(body["temperature"], bool):
            raise invalid("temperature", "must be a number, got bool")
        request.temperature = float(body["temperature"])
    if body.get("score_ids") is not None:
        request.score_ids.CopyFrom(_score_ids(body["score_ids"]))
    return request


def decode_body(raw: bytes, content_type: str) -> scoring_pb2.ScoreRequest:
    """A ScoreRequest from a JSON or protobuf body; ScoringError names what is wrong."""
    if content_type == PROTOBUF_MEDIA_TYPE:
        message = scoring_pb2.ScoreRequest()
        try:
            message.ParseFromString(raw)
        except DecodeError as exc:
            raise invalid("body", "is not a valid ScoreRequest protobuf") from exc
        return message
    if content_type in ("application/json", ""):
        return request_from_json(loads_bounded(raw, field="body"))
    raise invalid("content-type", f"{content_type!r} is not supported: use application/json or {PROTOBUF_MEDIA_TYPE}")


def _too_large(size: int | str, limit: int) -> ScoringError:
    return ScoringError(Code.PAYLOAD_TOO_LARGE, f"body: {size} bytes exceed the limit of {limit}", field="body")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit`: up front from Content-Length,
    else while it streams in (chunked bodies declare no length)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(declared, limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(f"more than {limit}", limit)
    except ClientDisconnect:
        raise ScoringError(Code.CANCELLED, "body: the client went away before sending all of it", field="body") from None
    return bytes(body)


_SCORE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object", "properties": {
                "teacher_key": {"type": "string"},
                "token_ids": {"type": "array", "items": {"type": "integer"}},
                "prompt_length": {"type": "integer"},
                "logprobs": {"type": "boolean"},
                "topk": {"type": "integer"},
                "hidden_states": {"type": "boolean"},
                "score_ids": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                "request_id": {"type": "string"},
            }, "required": ["token_ids"]}},
            PROTOBUF_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


def _timeout(request: Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError as exc:
        raise invalid(TIMEOUT_HEADER, f"must be seconds as a number, got {raw!r}") from exc
    if value != value or value < 0:
        raise invalid(TIMEOUT_HEADER, "must be a non-negative number of seconds")
    return value


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


class BearerTokenMiddleware:
    """Plain ASGI middleware: refuses calls without the token, otherwise passes the ASGI
    channels through untouched (Starlette's `@app.middleware("http")` wraps `receive`, which
    hides a client's disconnect from the handler and so would keep cancelled work running)."""

    def __init__(self, app, *, auth: TokenAuth, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.auth = auth
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope.get("headers") or ())
            value = headers.get(b"authorization")
            if not self.auth.allows(value.decode("latin-1") if value is not None else None):
                error = ScoringError(Code.UNAUTHENTICATED, "missing or invalid bearer token (Authorization header)")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    service: ScoringService,
    responses: Responses,
    options: ServerOptions,
    *,
    auth: TokenAuth | None = None,
) -> FastAPI:
    max_body_bytes = options.max_message_bytes
    auth = auth or TokenAuth(None)
    app = FastAPI(title="proctor", version="1", summary="Teacher scoring for on-policy distillation")
    if auth.enabled:
        app.add_middleware(BearerTokenMiddleware, auth=auth, open_paths=options.open_paths)

    async def parse(request: Request) -> tuple[scoring_pb2.ScoreRequest, str]:
        """The request's ScoreRequest (JSON or protobuf body) and its content type; a large
        body is decoded off the event loop."""
        raw = await read_body(request, max_body_bytes)
        content_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
        if len(raw) <= INLINE_DECODE_BYTES:
            return decode_body(raw, content_type), content_type
        return await asyncio.to_thread(decode_body, raw, content_type), content_type

    async def score_unless_disconnected(
        request: Request, message: scoring_pb2.ScoreRequest, *, unary: bool
    ) -> ScoredRequest | None:
        """Score, but withdraw the request (None) if the client goes away first."""
        task = asyncio.ensure_future(service.score(message, timeout=_timeout(request), unary=unary))
        watcher = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ScoringError):
            await task
        return None

    async def score_all_unless_disconnected(
        request: Request, messages: list[scoring_pb2.ScoreRequest], *, unary: bool
    ) -> list[ScoredRequest] | None:
        """Score several messages at once (a /v1/completions body's prompts), answers in order.
        The first error fails the call and withdraws the rest; all are withdrawn (None) if the
        client goes away first. One disconnect watcher for the lot: one per prompt would poll the
        connection thousands of times a second for a body of thousands of prompts."""
        timeout = _timeout(request)
        jobs = [asyncio.ensure_future(service.score(message, timeout=timeout, unary=unary)) for message in messages]
        everything = asyncio.gather(*jobs)
        everything.add_done_callback(lambda done: done.cancelled() or done.exception())  # read here or below
        watcher = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({everything, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not all(job.done() for job in jobs):  # an error, the client gone, or this call cancelled
                for job in jobs:
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
        if not everything.done():
            return None
        return everything.result()  # the first error, if any, is raised here

    @app.post("/v1/score", summary="Score one sequence with a teacher", openapi_extra=_SCORE_BODY)
    async def score(request: Request) -> Response:
        try:
            message, content_type = await parse(request)
            scored = await score_unless_disconnected(request, message, unary=True)
        except ScoringError as error:
            return error_response(error)
        if scored is None:
            return Response(status_code=499)
        accept = request.headers.get("accept", "")
        if PROTOBUF_MEDIA_TYPE in accept or (content_type == PROTOBUF_MEDIA_TYPE and "application/json" not in accept):
            return Response(responses.protobuf(scored), media_type=PROTOBUF_MEDIA_TYPE)
        if responses.json_is_large(scored):  # encoded piece by piece on a worker thread, never on the loop
            return StreamingResponse(responses.json_pieces(scored), media_type=JSON_MEDIA_TYPE)
        return Response(responses.json(scored), media_type=JSON_MEDIA_TYPE)

    @app.post(
        "/v1/score/stream",
        summary="Score one sequence; the answer is length-delimited ScoreChunk messages (hidden states in whole rows)",
        openapi_extra=_SCORE_BODY,
    )
    async def score_stream(request: Request) -> Response:
        try:
            message, _ = await parse(request)
            scored = await score_unless_disconnected(request, message, unary=False)
        except ScoringError as error:
            return error_response(error)
        if scored is None:
            return Response(status_code=499)

        return StreamingResponse((frame(chunk) for chunk in responses.chunks(scored)), media_type=STREAM_MEDIA_TYPE)

    @app.get(
        "/v1/unembedding",
        summary="The teacher's lm_head [V, H] as length-delimited TensorChunk messages of whole rows",
    )
    async def unembedding(teacher_key: str = "") -> Response:
        try:
            weight, fingerprint = await service.unembedding(teacher_key)
        except ScoringError as error:
            return error_response(error)
        return StreamingResponse(
            (frame(chunk) for chunk in responses.unembedding(weight, fingerprint)),
            media_type=STREAM_MEDIA_TYPE,
        )

    @app.get("/v1/teachers", summary="The teachers this server scores with")
    async def teachers() -> dict:
        from google.protobuf.json_format import MessageToDict

        return {
            "teachers": [
                MessageToDict(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                for info in service.teacher_infos()
            ]
        }

    @app.get("/health/live", summary="The process is up")
    async def live() -> dict:
        return {"status": "live", "state": service.state.value}

    @app.get("/health/ready", summary="Every teacher has a healthy replica and the server admits work")
    async def ready() -> Response:
        if service.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "state": service.state.value}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # vLLM's scoring surface (/health, /v1/models, /v1/completions) over the same service.
    mount_openai_compat(app, service, responses, max_body_bytes=max_body_bytes,
                        score_all=score_all_unless_disconnected, read_body=read_body)
    return app
