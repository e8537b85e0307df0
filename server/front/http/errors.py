"""A ScoringError as an HTTP answer, in proctor's shape, OpenAI's or SGLang's.

`/v1/score` answers `{"error": {"code", "message", "field"}}` with the contract's status;
vLLM's surface answers `{"error": {"message", "type", "param", "code"}}` with the status a vLLM
server gives (400 for bad input, where the contract says 422); SGLang's `/generate` answers
`{"error": {"message"}}`, 400 for bad input too. All carry the same retry hint,
formatted once here: `Retry-After` in whole seconds (RFC 9110), and for proctor's own clients
the same hint to the millisecond.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import JSONResponse

from proctor.proto.wire import RETRY_AFTER_HEADER, RETRY_AFTER_MS_HEADER
from proctor.server.common.errors import Code, ScoringError

# OpenAI's error `type` per contract status.
_OPENAI_TYPES = {
    "INVALID_ARGUMENT": "invalid_request_error",
    "NOT_FOUND": "not_found_error",
    "PAYLOAD_TOO_LARGE": "invalid_request_error",
    "UNAUTHENTICATED": "authentication_error",
    "RESOURCE_EXHAUSTED": "rate_limit_error",
    "UNAVAILABLE": "service_unavailable_error",
    "DEADLINE_EXCEEDED": "timeout_error",
    "CANCELLED": "cancelled_error",
}


def retry_headers(error: ScoringError, *, millis: bool) -> dict[str, str]:
    """The retry hint of a refusal (429, 503) as headers; none for an error without one."""
    if error.retry_after is None:
        return {}
    headers = {RETRY_AFTER_HEADER: str(max(1, round(error.retry_after)))}
    if millis:
        headers[RETRY_AFTER_MS_HEADER] = str(int(error.retry_after * 1000))
    return headers


def error_response(error: ScoringError) -> JSONResponse:
    """proctor's error answer: the contract's status and `{"error": {"code", "message", "field"}}`."""
    body = {"error": {"code": error.code.name, "message": error.message, "field": error.field}}
    return JSONResponse(body, status_code=error.code.http_status, headers=retry_headers(error, millis=True))


def openai_error(error: ScoringError) -> JSONResponse:
    """A ScoringError in OpenAI's error shape, with the status a vLLM server would give."""
    status = 400 if error.code is Code.INVALID_ARGUMENT else error.code.http_status
    body = {"error": {"message": error.message, "type": _OPENAI_TYPES.get(error.code.name, "internal_server_error"),
                      "param": error.field, "code": status}}
    return JSONResponse(body, status_code=status, headers=retry_headers(error, millis=False))


def sglang_error(error: ScoringError) -> JSONResponse:
    """A ScoringError in the shape SGLang's `/generate` answers a request it refuses:
    `{"error": {"message"}}`, 400 for bad input (as its tokenizer manager's ValueError is)."""
    status = 400 if error.code is Code.INVALID_ARGUMENT else error.code.http_status
    return JSONResponse({"error": {"message": error.message}}, status_code=status,
                        headers=retry_headers(error, millis=False))


def named_by_surface(error: ScoringError, names: Mapping[str, str]) -> ScoringError:
    """A refusal of the service under the field names a surface's own request gives (`teacher_key`
    is vLLM's `model`, say); its message stays the rule's own."""
    field = names.get(error.field or "")
    if field is None:
        return error
    message = error.message.removeprefix(f"{error.field}: ")
    return ScoringError(error.code, f"{field}: {message}", field=field, retry_after=error.retry_after)
