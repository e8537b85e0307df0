"""The one rule that sorts a vLLM-family engine's exceptions by vLLM's own types.

vLLM (0.32) says itself what is whose fault: `AsyncLLM.encode/generate` re-raise its client
errors (`VLLMClientError`: `VLLMValidationError` for a prompt of max_model_len tokens or a
parameter it refuses, `VLLMUnprocessableEntityError`, ...) unwrapped; `EngineDeadError` when the
EngineCore died; and wrap anything else in `EngineGenerateError` ("possibly recoverable").
So:
- a vLLM client error is the request's (`RequestRejected`, INVALID_ARGUMENT naming its field);
- `EngineDeadError` is the replica's (`EngineError`: it is taken out and restarted);
- anything else (`EngineGenerateError` and its cause, a proctor bug, an API mismatch between
  proctor and vLLM) is a server fault of that request (`RequestFailed`, INTERNAL), logged with
  its traceback; routing retries it once elsewhere and counts it toward the replica's health
  (`front.fleet.replica_faults`). A bare ValueError is no longer taken for the caller's fault.

The input processing of a request's own fields that proctor runs itself (rendering its media
through vLLM's renderer) is classified where it runs (`input_error`): there a ValueError or
TypeError is the processor refusing that request's media.
"""

from __future__ import annotations

import logging

from proctor.server.engines.base import (
    EngineError,
    EngineRequest,
    RequestFailed,
    RequestRejected,
)
from proctor.server.engines.faults import describe_fault
from proctor.server.engines.vllm.adapter import vllm_error_types

log = logging.getLogger(__name__)

# What a processor raises when it refuses an input (PIL, the HF processors, vLLM's renderer).
_PROCESSOR_REFUSALS = (ValueError, TypeError)


def _request_field(request: EngineRequest, message: str, parameter: str | None = None) -> str:
    """The wire field a complaint is about: the media kind it names, else the token ids."""
    lowered = f"{parameter or ''} {message}".lower()
    for kind in request.media.kinds() if request.media else ():
        if kind.rstrip("s") in lowered:
            return kind
    return "token_ids"


def classify_error(request: EngineRequest, exc: BaseException) -> RequestRejected | RequestFailed | EngineError:
    """A request error, a server fault of this request, or a replica error (the module's rule)."""
    if isinstance(exc, RequestRejected | RequestFailed | EngineError):
        return exc
    client_errors, dead_errors = vllm_error_types()
    if isinstance(exc, client_errors):
        message = str(exc) or type(exc).__name__
        parameter = getattr(exc, "parameter", None)
        return RequestRejected(_request_field(request, message, parameter), message, request_id=request.request_id)
    if isinstance(exc, dead_errors):
        return EngineError(f"vLLM's engine is dead: {describe_fault(exc)}")
    log.error("vLLM failed request %s", request.request_id, exc_info=exc)
    return RequestFailed(f"vLLM failed on this request: {describe_fault(exc)}")


def input_error(request: EngineRequest, exc: BaseException) -> RequestRejected | RequestFailed | EngineError:
    """An exception from processing this request's media before it reaches the engine: the
    processor refusing it is the request's; anything else by `classify_error`."""
    if isinstance(exc, _PROCESSOR_REFUSALS) and not isinstance(exc, vllm_error_types()[0]):
        message = str(exc) or type(exc).__name__
        return RequestRejected(_request_field(request, message), f"the model's processor rejects it: {message}",
                               request_id=request.request_id)
    return classify_error(request, exc)
