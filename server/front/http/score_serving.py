"""proctor's own scoring endpoints served over the ScoringService: `/v1/score`, its stream and
the teacher's unembedding.

A body is `application/json` (checked by `ScoreBody`) or `application/x-protobuf` (the
`ScoreRequest` message itself); the unary answer is in the request's format unless `Accept`
asks for the other. `Responses` builds every answer; a large JSON answer is encoded piece by
piece on a worker thread, as a large body is decoded there. A client that disconnects before its
answer withdraws its request (499).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from google.protobuf.message import DecodeError

from proctor.proto import scoring_pb2
from proctor.proto.framing import STREAM_MEDIA_TYPE, frame
from proctor.proto.wire import JSON_MEDIA_TYPE, PROTOBUF_MEDIA_TYPE
from proctor.server.common.errors import ScoringError, invalid
from proctor.server.common.off_loop import off_loop_if
from proctor.server.front.bounded_json import loads_bounded
from proctor.server.front.http.cancellation import ClientGone, cancel_on_disconnect, client_gone
from proctor.server.front.http.errors import error_response
from proctor.server.front.http.models import ScoreBody
from proctor.server.front.http.request import (
    INLINE_BODY_BYTES,
    content_type,
    read_body,
    request_timeout,
)
from proctor.server.front.http.teacher_paths import path_key, routing_key
from proctor.server.front.responses import Responses
from proctor.server.front.service import ScoredRequest, ScoringService

# /v1/score's body in OpenAPI: the JSON model, or the protobuf message's bytes.
SCORE_OPENAPI = ScoreBody.openapi_body(**{PROTOBUF_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}})


def decode_body(raw: bytes, kind: str, max_numbers: int | None = None) -> scoring_pb2.ScoreRequest:
    """A ScoreRequest from a JSON or protobuf body; ScoringError names what is wrong. A JSON body
    holding more than `max_numbers` numbers is refused before it is parsed."""
    if kind == PROTOBUF_MEDIA_TYPE:
        message = scoring_pb2.ScoreRequest()
        try:
            message.ParseFromString(raw)
        except DecodeError as exc:
            raise invalid("body", "is not a valid ScoreRequest protobuf") from exc
        return message
    if kind in ("application/json", ""):
        return ScoreBody.check(loads_bounded(raw, field="body", max_numbers=max_numbers)).message()
    raise invalid("content-type", f"{kind!r} is not supported: use application/json or {PROTOBUF_MEDIA_TYPE}")


class ScoreServing:
    """`/v1/score`, `/v1/score/stream` and `/v1/unembedding` over one ScoringService."""

    def __init__(self, service: ScoringService, responses: Responses, *, max_body_bytes: int) -> None:
        self.service = service
        self.responses = responses
        self.max_body_bytes = max_body_bytes

    async def _answer(self, request: Request, answer: Callable[[Request, ScoredRequest], Response], *,
                      unary: bool) -> Response:
        """The body read, then decoded and scored unless the client leaves first (499), then
        `answer`ed; an error is answered in proctor's shape."""
        try:
            raw = await read_body(request, self.max_body_bytes)
            scored = await cancel_on_disconnect(request, self._decode_and_score(request, raw, unary=unary))
        except ScoringError as error:
            return error_response(error)
        except ClientGone:
            return client_gone()
        return answer(request, scored)

    async def _decode_and_score(self, request: Request, raw: bytes, *, unary: bool) -> ScoredRequest:
        message = await off_loop_if(len(raw) > INLINE_BODY_BYTES, decode_body, raw, content_type(request),
                                    self.service.most_body_numbers())
        message.teacher_key = routing_key(self.service.router, path_key(request.scope.get("state")),
                                          message.teacher_key, "teacher_key")
        return await self.service.score(message, timeout=request_timeout(request), unary=unary)

    async def score(self, request: Request) -> Response:
        """One sequence scored, answered in one message (protobuf or JSON)."""
        return await self._answer(request, self._unary, unary=True)

    async def score_stream(self, request: Request) -> Response:
        """One sequence scored, answered as length-delimited ScoreChunks (hidden states in rows)."""
        return await self._answer(request, self._stream, unary=False)

    def _unary(self, request: Request, scored: ScoredRequest) -> Response:
        accept, kind = request.headers.get("accept", ""), content_type(request)
        if PROTOBUF_MEDIA_TYPE in accept or (kind == PROTOBUF_MEDIA_TYPE and JSON_MEDIA_TYPE not in accept):
            return Response(self.responses.protobuf(scored), media_type=PROTOBUF_MEDIA_TYPE)
        if self.responses.json_is_large(scored):  # encoded piece by piece on a worker thread, never on the loop
            return StreamingResponse(self.responses.json_pieces(scored), media_type=JSON_MEDIA_TYPE)
        return Response(self.responses.json(scored), media_type=JSON_MEDIA_TYPE)

    def _stream(self, request: Request, scored: ScoredRequest) -> Response:
        return StreamingResponse((frame(chunk) for chunk in self.responses.chunks(scored)), media_type=STREAM_MEDIA_TYPE)

    async def unembedding(self, request: Request, teacher_key: str, projected: bool = False) -> Response:
        """The teacher's lm_head [V, H] (`projected`: W·P [V, r]) as length-delimited TensorChunks of whole rows."""
        try:
            teacher_key = routing_key(self.service.router, path_key(request.scope.get("state")), teacher_key,
                                      "teacher_key")
            weight, fingerprint = await self.service.unembedding(teacher_key, projected)
        except ScoringError as error:
            return error_response(error)
        chunks = self.responses.unembedding(weight, fingerprint)
        return StreamingResponse((frame(chunk) for chunk in chunks), media_type=STREAM_MEDIA_TYPE)
