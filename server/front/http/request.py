"""What every HTTP scoring call reads the same way, whatever its endpoint.

The body is read under the size limit (413 as soon as it passes it) and the deadline comes from
one header: the same rules for `/v1/score` and `/v1/completions`, so they are written here once
(a large body is decoded off the loop by `proctor.server.common.off_loop`).
"""

from __future__ import annotations

from fastapi import Request
from starlette.requests import ClientDisconnect

from proctor.proto.wire import TIMEOUT_HEADER
from proctor.server.common.errors import Code, ScoringError, invalid

# Bodies above this size are decoded in a worker thread. bounded_json calls back into Python
# for every number, so that thread yields the GIL and the event loop (gRPC included) keeps
# serving while a large body is decoded; small bodies are not worth a thread hop.
INLINE_BODY_BYTES = 256 << 10


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


def content_type(request: Request) -> str:
    """The body's media type without its parameters (`application/json; charset=utf-8` is JSON)."""
    return request.headers.get("content-type", "application/json").split(";")[0].strip()


def request_timeout(request: Request) -> float | None:
    """The caller's deadline in seconds (the HTTP twin of a gRPC deadline), None without one."""
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
