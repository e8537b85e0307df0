"""The wire's constants, read by the server and the client alike: one home for each.

- the status table: every status name of the contract with its gRPC code and HTTP status,
  and whether the same request may succeed later (the only statuses a client retries);
- the HTTP header and media-type names that carry what gRPC carries natively.

`PAYLOAD_TOO_LARGE` is a request too large to send or answer: HTTP keeps the precise 413, but
on gRPC it is INVALID_ARGUMENT, like any other bad input. RESOURCE_EXHAUSTED would tell every
client (ours, and gRPC's own retry policies) that the same request may pass later, so a
message that can never fit would be retried forever.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOBUF_MEDIA_TYPE = "application/x-protobuf"
JSON_MEDIA_TYPE = "application/json"
TIMEOUT_HEADER = "x-request-timeout"  # seconds, the HTTP twin of a gRPC deadline
RETRY_AFTER_HEADER = "retry-after"  # whole seconds (RFC 9110)
RETRY_AFTER_MS_HEADER = "x-retry-after-ms"  # the same hint, to the millisecond
GRPC_RETRY_AFTER_KEY = "retry-after"  # trailing metadata: seconds
GRPC_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's own retry-throttling hint


@dataclass(frozen=True)
class Status:
    """One status of the contract."""

    name: str
    grpc_code: str  # grpc.StatusCode member name
    http_status: int
    retryable: bool = False


STATUSES: dict[str, Status] = {
    s.name: s
    for s in (
        Status("INVALID_ARGUMENT", "INVALID_ARGUMENT", 422),
        Status("NOT_FOUND", "NOT_FOUND", 404),
        Status("RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED", 429, retryable=True),
        Status("UNAVAILABLE", "UNAVAILABLE", 503, retryable=True),
        Status("UNAUTHENTICATED", "UNAUTHENTICATED", 401),
        Status("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", 504),
        Status("CANCELLED", "CANCELLED", 499),
        Status("PAYLOAD_TOO_LARGE", "INVALID_ARGUMENT", 413),
        Status("INTERNAL", "INTERNAL", 500),
    )
}
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
RETRYABLE = frozenset(name for name, status in STATUSES.items() if status.retryable)

# HTTP statuses a client may meet that the server never sends itself (proxies, frameworks).
_FOREIGN_HTTP = {400: "INVALID_ARGUMENT", 502: "UNAVAILABLE"}
HTTP_TO_STATUS: dict[int, str] = {**_FOREIGN_HTTP, **{s.http_status: s.name for s in STATUSES.values()}}


def status_of_http(code: int) -> str:
    """The contract's status name for an HTTP status code ("UNKNOWN" when none fits)."""
    return HTTP_TO_STATUS.get(code, "UNKNOWN")
