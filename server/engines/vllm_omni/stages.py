"""vLLM-Omni's stage processes as proctor watches them: the rule that sorts a stage's errors
into request errors and replica errors, the stage processes' liveness, and the log tail a
failed start is reported with. See `engine` for the upstream behaviour mirrored.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
from collections.abc import Mapping
from typing import Any

from proctor.server.engines.base import (
    EngineError,
    EngineRequest,
    RequestFailed,
    RequestRejected,
)
from proctor.server.engines.vllm.errors import classify_error

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40  # lines of vLLM-Omni's and vLLM's log a failed start is reported with


# --------------------------------------------------------------------------------------------
# Stage errors: the request's fault or the replica's
# --------------------------------------------------------------------------------------------

# Exception classes (matched by name along the MRO, so nothing of vLLM is imported here) that
# say the engine, not the request, failed: vLLM's EngineDeadError (0.30.0's OmniEngineDeadError
# derives from it) and EngineGenerateError.
ENGINE_FAILURE_TYPES = frozenset({"EngineDeadError", "OmniEngineDeadError", "EngineGenerateError"})
# Message shapes of input rejections, each with the request field it names. vLLM's InputProcessor
# ("The decoder prompt (length N) is longer than the maximum model length of M"), its multimodal
# processor ("Expected there to be N prompt updates corresponding to N image items, but instead
# found M prompt updates", "... placeholder ...", failures to load an item), and processor kwargs
# the HF processor does not take ("got an unexpected keyword argument").
_REJECTION_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), field)
    for pattern, field in (
        (r"maximum model length|max_model_len|longer than|too long|exceeds? the maximum", "token_ids"),
        (r"mm_processor_kwargs|unexpected keyword argument|processor kwargs?", "mm_processor_kwargs"),
        (r"prompt updates|placeholder", "media"),
        (r"\bimages?\b", "images"),
        (r"\bvideos?\b|\bframes?\b", "videos"),
        (r"\baudios?\b|waveform|sampling.rate", "audios"),
        (r"\btoken(?:_ids)?\b|\bvocab", "token_ids"),
    )
)


def _error_text(exc: BaseException) -> str:
    """The message of a stage error; 0.18.0 raises `RuntimeError(result)` with the orchestrator's
    `{"request_id", "stage_id", "error"}` dict as its argument."""
    arg = exc.args[0] if exc.args else None
    if isinstance(arg, Mapping) and "error" in arg:
        return str(arg["error"])
    return str(exc)


def _client_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    return int(status) if isinstance(status, int) else None


def classify_stage_error(exc: BaseException, request: EngineRequest) -> RequestRejected | RequestFailed | EngineError:
    """The outcome of an exception from `AsyncOmni.generate`: that request's rejection, or an
    `EngineError` when the engine (not the request) failed.

    How the pinned versions report a request's failure, and how it is read here:
    - 0.30.0 processes inputs in the caller (`AsyncOmniEngine.add_request` →
      `InputProcessor.process_inputs`), so a prompt too long, media the processor refuses or
      placeholders that do not match the media raise vLLM's `ValueError` (its API server's 400)
      or, for a placeholder count mismatch, its `RuntimeError` out of `generate()`.
    - 0.30.0 stage errors come back as an `ErrorMessage` on the request's queue
      (`engine/messages.py`); `OmniBase._raise_nonfatal_error_message` /
      `_check_engine_output_error` raise `OmniClientError` (a `ValueError` with a 4xx
      `status_code`, `errors.py:raise_client_error_or`) for client errors, else
      `RuntimeError` / `EngineGenerateError`; a fatal one (dead replica) raises
      `OmniEngineDeadError`.
    - 0.18.0 raises `RuntimeError(<the orchestrator's error dict>)` for any stage error
      (`AsyncOmni._process_orchestrator_results`), so there only the message tells.
    Rules: dead/generate-error types are the engine's; a 4xx status or a `ValueError` is the
    request's; a `RuntimeError` is the request's only when its message has an input-rejection
    shape (`_REJECTION_PATTERNS`); anything else goes to the vLLM family's rule
    (`vllm_errors.classify_error`): a server fault of that request (`RequestFailed`), which
    routing retries once elsewhere and weighs toward the replica's health.
    """
    if isinstance(exc, RequestRejected | EngineError):
        return exc
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = _error_text(exc)
    if names & ENGINE_FAILURE_TYPES:
        return EngineError(f"vLLM-Omni stage failed: {type(exc).__name__}: {text}")
    status = _client_status(exc)
    field = _rejected_field(text, request)
    if (status is not None and 400 <= status < 500) or isinstance(exc, ValueError):
        return RequestRejected(field or _default_field(request), text, request_id=request.request_id)
    if isinstance(exc, RuntimeError) and field is not None:
        return RequestRejected(field, text, request_id=request.request_id)
    return classify_error(request, exc)


def _rejected_field(text: str, request: EngineRequest) -> str | None:
    for pattern, field in _REJECTION_PATTERNS:
        if pattern.search(text):
            return _default_field(request) if field == "media" else field
    return None


def _default_field(request: EngineRequest) -> str:
    """The field a rejection names when its message does not: the media, else the tokens."""
    kinds = request.media.kinds() if request.media else []
    return kinds[0] if kinds else "token_ids"


# --------------------------------------------------------------------------------------------
# Stage processes and start-up logs
# --------------------------------------------------------------------------------------------


def child_processes() -> dict[int, Any]:
    """This process's live direct children (psutil.Process by pid); {} without psutil."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with vLLM
        return {}
    children = {}
    for child in psutil.Process().children(recursive=False):
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(child.cmdline()):  # multiprocessing's helper
                children[child.pid] = child
    return children


def process_exit(process: Any) -> str | None:
    """Why a stage process is gone ("exited", "zombie"), or None while it runs."""
    import psutil

    try:
        if not process.is_running():
            return "exited"
        if process.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped by its parent
            return "exited (zombie)"
    except psutil.NoSuchProcess:
        return "exited"
    except psutil.Error as exc:  # pragma: no cover - permissions
        return f"unreadable ({exc})"
    return None


class LogTail(logging.Handler):
    """The last lines vLLM-Omni (and vLLM) logged in this process, for a start-up error.

    The orchestrator runs in a thread of this process in both pinned versions and logs each
    stage's start-up progress and failures there.
    """

    LOGGERS = ("vllm_omni", "vllm")

    def __init__(self, lines: int = LOG_TAIL_LINES) -> None:
        super().__init__(logging.INFO)
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.lines.append(f"{record.name}: {record.getMessage()}")

    @contextlib.contextmanager
    def attached(self):
        loggers = [logging.getLogger(name) for name in self.LOGGERS]
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield self
        finally:
            for logger in loggers:
                logger.removeHandler(self)

    def text(self) -> str:
        return "\n".join(self.lines) or "(vLLM-Omni logged nothing in this process)"
