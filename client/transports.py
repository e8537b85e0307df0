"""What every transport offers the client, and how a failed call is reported.

The client speaks the wire messages of `proctor.proto` and nothing else; a transport moves
them over gRPC or HTTP and turns that protocol's failures into one `TeacherError` family,
so retries, deadlines and callers never look at `grpc.StatusCode` or HTTP statuses.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from proctor.proto import scoring_pb2
from proctor.proto.wire import PAYLOAD_TOO_LARGE, RETRYABLE

# The codes that mean "the same request may succeed later" (the only ones the client retries)
# are the wire table's; a request too large to send or receive (PAYLOAD_TOO_LARGE: HTTP 413,
# or gRPC's RESOURCE_EXHAUSTED "message larger than max") is not among them.
RETRYABLE_CODES = RETRYABLE
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]-]*): ")


class TeacherError(Exception):
    """A scoring call failed; `code` is the contract's status name (e.g. "INVALID_ARGUMENT").

    `field` names the offending request field when the server said which; `retry_after` is
    the server's hint in seconds (429/503, RESOURCE_EXHAUSTED/UNAVAILABLE), else None.
    """

    def __init__(
        self, code: str, message: str, *, field: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES


class InvalidArgument(TeacherError, ValueError):
    """The request is malformed; `field` says which part (never retried)."""


class PayloadTooLarge(InvalidArgument):
    """The request (or its answer) exceeds a message size limit; shrink it or use streaming
    (never retried)."""


class TeacherNotFound(TeacherError, LookupError):
    """No teacher serves the given key."""


class Unauthenticated(TeacherError, PermissionError):
    """Missing or wrong bearer token."""


class Unavailable(TeacherError):
    """The server is loading, draining, restarting or unreachable (retried)."""


class ResourceExhausted(TeacherError):
    """The teacher's queue is full (retried after the server's hint)."""


class DeadlineExceeded(TeacherError, TimeoutError):
    """The call's deadline passed (a TimeoutError, so `except TimeoutError` catches it)."""


class UnembeddingMismatch(TeacherError):
    """The unembedding streamed does not belong to the teacher ListTeachers describes."""


_ERROR_TYPES: dict[str, type[TeacherError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    PAYLOAD_TOO_LARGE: PayloadTooLarge,
    "NOT_FOUND": TeacherNotFound,
    "UNAUTHENTICATED": Unauthenticated,
    "UNAVAILABLE": Unavailable,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
}


def make_error(
    code: str, message: str, *, field: str | None = None, retry_after: float | None = None
) -> TeacherError:
    """The most specific TeacherError for a status name; the field is read off the message
    ("token_ids: ...") when the transport did not carry it separately (gRPC has no slot)."""
    if field is None and code in ("INVALID_ARGUMENT", "NOT_FOUND", PAYLOAD_TOO_LARGE):
        match = _FIELD_PREFIX.match(message)
        field = match.group(1) if match else None
    cls = _ERROR_TYPES.get(code, TeacherError)
    return cls(code, message, field=field, retry_after=retry_after)


@dataclass(frozen=True)
class Media:
    """One encoded media item exactly as the rollout used it (bytes plus its media type)."""

    data: bytes
    media_type: str


MediaLike = Media | tuple[bytes, str] | scoring_pb2.Media


def to_wire_media(items: Iterable[MediaLike] | None, field: str) -> list[scoring_pb2.Media]:
    """Accept Media, (bytes, media_type) tuples or wire messages; refuse anything else early."""
    out: list[scoring_pb2.Media] = []
    for index, item in enumerate(items or ()):
        if isinstance(item, scoring_pb2.Media):
            out.append(item)
            continue
        if isinstance(item, Media):
            data, media_type = item.data, item.media_type
        elif isinstance(item, tuple) and len(item) == 2:
            data, media_type = item
        else:
            raise InvalidArgument(
                "INVALID_ARGUMENT",
                f"{field}[{index}]: give Media(data, media_type) or a (bytes, media_type) tuple, "
                f"not {type(item).__name__}",
                field=f"{field}[{index}]",
            )
        if not isinstance(data, (bytes, bytearray, memoryview)) or not isinstance(media_type, str) or not media_type:
            raise InvalidArgument(
                "INVALID_ARGUMENT",
                f"{field}[{index}]: data must be bytes and media_type a non-empty string (e.g. image/png)",
                field=f"{field}[{index}]",
            )
        out.append(scoring_pb2.Media(data=bytes(data), media_type=media_type))
    return out


def processor_kwargs_json(kwargs: Mapping[str, Any] | str | None) -> str:
    if not kwargs:
        return ""
    return kwargs if isinstance(kwargs, str) else json.dumps(dict(kwargs))


class Transport(abc.ABC):
    """One connection to a server. Every method raises TeacherError on failure.

    `timeout` is the time left for this attempt (seconds, None for no limit); the transport
    tells the server (gRPC deadline, `x-request-timeout`) so that abandoned work stops there.
    """

    name: str

    @abc.abstractmethod
    async def score(self, request: scoring_pb2.ScoreRequest, timeout: float | None) -> scoring_pb2.ScoreResponse:
        """One unary Score call."""

    @abc.abstractmethod
    def score_stream(
        self, request: scoring_pb2.ScoreRequest, timeout: float | None
    ) -> AsyncIterator[scoring_pb2.ScoreChunk]:
        """The server's chunks for one request (header first, hidden states after)."""

    @abc.abstractmethod
    async def list_teachers(self, timeout: float | None) -> scoring_pb2.TeachersResponse:
        """The server's teacher catalogue."""

    @abc.abstractmethod
    def unembedding(
        self, teacher_key: str, timeout: float | None, *, projected: bool = False
    ) -> AsyncIterator[scoring_pb2.TensorChunk]:
        """The teacher's lm_head weight in row chunks (`projected`: W·P)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections (idempotent)."""


def parse_target(target: str) -> tuple[str, str]:
    """("grpc" | "grpcs" | "http" | "https", address) from a target URL; bare host:port is gRPC."""
    for scheme in ("grpcs", "grpc", "https", "http"):
        prefix = f"{scheme}://"
        if target.startswith(prefix):
            address = target[len(prefix):].rstrip("/")
            if not address:
                raise ValueError(f"target {target!r} has no host:port")
            return scheme, address
    if "://" in target:
        raise ValueError(f"target {target!r}: use grpc://host:port or http://host:port")
    return "grpc", target
