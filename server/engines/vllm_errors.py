"""The one rule that sorts a vLLM-family engine's exceptions: a request error or a replica error."""

from __future__ import annotations

import logging

from proctor.server.engines import EngineConfigError
from proctor.server.engines.base import (
    EngineError,
    EngineRequest,
    RequestRejected,
)

log = logging.getLogger(__name__)




# Exception types (by name, so that vLLM need not be imported) that say "this request's input"
# when an input step raises them: vLLM's own client errors (VLLMValidationError for a prompt of
# max_model_len tokens, VLLMUnprocessableEntityError), and the ValueError/TypeError that its
# input processors (tokenizer, multimodal processors) raise, which AsyncLLM.generate wraps in
# EngineGenerateError.
_CLIENT_ERRORS = ("VLLMClientError", "VLLMValidationError", "VLLMUnprocessableEntityError")
_INPUT_ERRORS = (ValueError, TypeError)


def _is_client_error(exc: BaseException) -> bool:
    return any(cls.__name__ in _CLIENT_ERRORS for cls in type(exc).__mro__)


def _request_field(request: EngineRequest, message: str) -> str:
    """The wire field an engine's complaint is about: the media kind it names, else the ids."""
    lowered = message.lower()
    for kind in request.media.kinds() if request.media else ():
        if kind.rstrip("s") in lowered:
            return kind
    return "token_ids"


def classify_error(request: EngineRequest, exc: BaseException) -> RequestRejected | EngineError:
    """The one rule: a request error (the request's INVALID_ARGUMENT) or a replica error.

    A request error is an input the engine refused before computing anything: vLLM's client
    errors, or an EngineGenerateError caused by a ValueError/TypeError from input processing.
    Everything else that fails on a validated request (EngineDeadError: the EngineCore died;
    errors from the model's forward; a wrong-shaped answer) is the replica's.
    """
    if isinstance(exc, RequestRejected | EngineError):
        return exc
    cause = exc if _is_client_error(exc) else None
    if cause is None and type(exc).__name__ == "EngineGenerateError" and isinstance(exc.__cause__, _INPUT_ERRORS):
        cause = exc.__cause__
    if cause is None and isinstance(exc, _INPUT_ERRORS) and not isinstance(exc, EngineConfigError):
        cause = exc
    if cause is not None:
        message = str(cause) or type(cause).__name__
        return RequestRejected(_request_field(request, message), message, request_id=request.request_id)
    detail = f"{type(exc).__name__}: {exc}" + (f" (caused by {exc.__cause__!r})" if exc.__cause__ else "")
    return EngineError(detail)
