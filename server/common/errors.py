"""The error model of the wire contract, one exception for both transports.

The service raises `ScoringError(code, message)`; the gRPC shell turns it into a status, the
HTTP shell into a status code and `{"error": {"code", "message", "field"}}`. Messages name
the offending field so that a user can fix the request without reading server logs.
"""

from __future__ import annotations

import enum

import grpc

from proctor.proto.wire import STATUSES


class _StatusCode(enum.Enum):
    """A status of the contract (`proctor.proto.wire.STATUSES`) with its gRPC and HTTP codes."""

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return getattr(grpc.StatusCode, STATUSES[self.value].grpc_code)

    @property
    def http_status(self) -> int:
        return STATUSES[self.value].http_status


# Code.INVALID_ARGUMENT, Code.PAYLOAD_TOO_LARGE, ...: one member per status of the wire table.
Code = _StatusCode("Code", {name: name for name in STATUSES})


# Seconds a client should wait while a server or teacher is loading or draining.
NOT_READY_RETRY_S = 5.0


class ScoringError(Exception):
    """A request failed in a way the caller should be told about."""

    def __init__(
        self, code: Code, message: str, *, field: str | None = None, retry_after: float | None = None
    ) -> None:
        message = _bounded(_printable(message), MAX_MESSAGE_BYTES)
        field = _bounded(_printable(field), MAX_FIELD_BYTES) if field is not None else None
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message


# What an error may echo: a message (or field name) built from a hostile value is cut, so that
# it always fits gRPC's status metadata (8 KiB of headers by default) and an HTTP answer stays
# small; an overflowing status would turn the caller's error into RESOURCE_EXHAUSTED, retried.
# Bytes of UTF-8: gRPC percent-encodes a non-ASCII byte as 3, so 1 KiB stays under 3 KiB.
MAX_MESSAGE_BYTES = 1024
MAX_FIELD_BYTES = 128


def _bounded(text: str, limit: int) -> str:
    """`text`, or its first `limit` bytes of UTF-8 (whole characters) and how many were cut."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return f"{data[:limit].decode('utf-8', 'ignore')}... ({len(data) - limit} more bytes cut)"


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
