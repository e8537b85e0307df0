"""The error model of the wire contract, one exception for both transports.

The service raises `ScoringError(code, message)`; the gRPC shell turns it into a status, the
HTTP shell into a status code and `{"error": {"code", "message", "field"}}`. Messages name
the offending field so that a user can fix the request without reading server logs.
"""

from __future__ import annotations

import enum

import grpc


class Code(enum.Enum):
    INVALID_ARGUMENT = (grpc.StatusCode.INVALID_ARGUMENT, 422)
    NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404)
    RESOURCE_EXHAUSTED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429)
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503)
    UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, 401)
    DEADLINE_EXCEEDED = (grpc.StatusCode.DEADLINE_EXCEEDED, 504)
    CANCELLED = (grpc.StatusCode.CANCELLED, 499)
    # A body over the size limit can never succeed as sent, so on gRPC it is INVALID_ARGUMENT,
    # like any other bad input: RESOURCE_EXHAUSTED would tell clients (ours, and gRPC's own
    # retry policies) "the server is busy, the same request may pass later" and so retry it
    # forever. OUT_OF_RANGE was the alternative, but it means reading past a valid range
    # (iteration), and every client already treats INVALID_ARGUMENT as final and reads the
    # field ("body: ...") off the message. HTTP keeps the precise 413.
    PAYLOAD_TOO_LARGE = (grpc.StatusCode.INVALID_ARGUMENT, 413)
    INTERNAL = (grpc.StatusCode.INTERNAL, 500)

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]


class ScoringError(Exception):
    """A request failed in a way the caller should be told about."""

    def __init__(
        self, code: Code, message: str, *, field: str | None = None, retry_after: float | None = None
    ) -> None:
        message, field = _printable(message), _printable(field) if field is not None else None
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message


def _printable(text: str) -> str:
    """The text with any lone UTF-16 surrogate (from hostile JSON) written as an escape: both
    transports encode messages as UTF-8, which would fail on one and turn the 4xx into a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def invalid(field: str, message: str) -> ScoringError:
    """Bad input: the message starts with the field's name."""
    return ScoringError(Code.INVALID_ARGUMENT, f"{field}: {message}", field=field)
