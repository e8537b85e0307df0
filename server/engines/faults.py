"""How an exception an engine raised reads: whether it is an out-of-memory, and its one-line
cause for a request's INTERNAL message (the worker, the batch isolation and routing all read
faults by these, so the words agree wherever the fault is reported)."""

from __future__ import annotations

from proctor.server.engines.base import BatchFailed, RequestFailed

# Exception types (by name: torch's, its device plugins') that say "the device ran out of memory".
_OUT_OF_MEMORY_TYPES = ("OutOfMemoryError",)
_OUT_OF_MEMORY_TEXT = ("out of memory", "NPU out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a device (or host) out-of-memory: torch's `OutOfMemoryError` (CUDA),
    `MemoryError`, or a RuntimeError whose text says so (Ascend's torch_npu raises those)."""
    if isinstance(exc, BatchFailed | RequestFailed):
        return exc.out_of_memory
    if isinstance(exc, MemoryError) or any(cls.__name__ in _OUT_OF_MEMORY_TYPES for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _OUT_OF_MEMORY_TEXT)


def describe_fault(exc: BaseException) -> str:
    """One line naming an exception and its cause, for a request's INTERNAL message."""
    if isinstance(exc, BatchFailed | RequestFailed):
        return exc.cause
    detail = f"{type(exc).__name__}: {exc}"
    return detail + (f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else "")
