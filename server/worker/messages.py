"""The messages between the front and a replica worker: one kind each, one struct each, one codec.

Each message is a frozen struct named for what it says; `Kind` numbers them for the wire. The
codec (`encode` / `decode`) turns a struct into the tuple `(kind, *fields)` that `protocol`
frames and back, so that neither side dispatches on strings and a field added to a struct is
added on both sides at once. Tuples of plain values pickle faster than dataclass instances,
which is why the frame carries the tuple, not the struct.

front → worker: Start · Score · Abort · Health · Unembedding · Free · Close
worker → front: Ready · StartFailed · Reply · Failed (the replica is unwell: `EngineError`) ·
                Raised (the engine raised on this call, its process alive: the batch's fault)
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar


class Kind(enum.IntEnum):
    START = 1
    SCORE = 2
    ABORT = 3
    HEALTH = 4
    UNEMBEDDING = 5
    FREE = 6
    CLOSE = 7
    READY = 11
    START_FAILED = 12
    REPLY = 13
    FAILED = 14
    RAISED = 15


@dataclass(frozen=True, slots=True)
class Start:
    """Build and start the engine: `spec` an EngineSpec, `build` its factory (None: `create_engine`)."""

    KIND: ClassVar[Kind] = Kind.START
    spec: Any
    build: Callable[..., Any] | None


@dataclass(frozen=True, slots=True)
class Score:
    """Score a batch of EngineRequests; answered by `call`."""

    KIND: ClassVar[Kind] = Kind.SCORE
    call: int
    batch: list


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort the requests of these keys (their callers went away)."""

    KIND: ClassVar[Kind] = Kind.ABORT
    keys: list[str]


@dataclass(frozen=True, slots=True)
class Health:
    """Probe the engine (`check_health`)."""

    KIND: ClassVar[Kind] = Kind.HEALTH
    call: int


@dataclass(frozen=True, slots=True)
class Unembedding:
    """The model's own output embedding."""

    KIND: ClassVar[Kind] = Kind.UNEMBEDDING
    call: int


@dataclass(frozen=True, slots=True)
class Free:
    """Blocks of the worker's shared arena the front is done with."""

    KIND: ClassVar[Kind] = Kind.FREE
    offsets: list[int]


@dataclass(frozen=True, slots=True)
class Close:
    """Close the engine and end the worker."""

    KIND: ClassVar[Kind] = Kind.CLOSE


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine started: its EngineInfo and token budget."""

    KIND: ClassVar[Kind] = Kind.READY
    info: Any
    token_budget: int


@dataclass(frozen=True, slots=True)
class StartFailed:
    KIND: ClassVar[Kind] = Kind.START_FAILED
    message: str


@dataclass(frozen=True, slots=True)
class Reply:
    """A call's value."""

    KIND: ClassVar[Kind] = Kind.REPLY
    call: int
    value: Any


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine says the replica is unwell (an EngineError on this call)."""

    KIND: ClassVar[Kind] = Kind.FAILED
    call: int
    message: str


@dataclass(frozen=True, slots=True)
class Raised:
    """The engine raised on this call and lives on: the front splits the batch to find the culprit."""

    KIND: ClassVar[Kind] = Kind.RAISED
    call: int
    cause: str
    out_of_memory: bool


Message = Start | Score | Abort | Health | Unembedding | Free | Close | Ready | StartFailed | Reply | Failed | Raised
# A call's answer, whichever it is.
Answer = Reply | Failed | Raised
_BY_KIND: dict[int, type] = {cls.KIND: cls for cls in Message.__args__}
_FIELDS: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in Message.__args__}


def encode(message: Message) -> tuple[Any, ...]:
    """The tuple a frame carries: the kind, then the fields in order (not deep-copied)."""
    return (int(message.KIND), *(getattr(message, name) for name in _FIELDS[type(message)]))


def decode(raw: tuple[Any, ...]) -> Message:
    """The struct a frame's tuple stands for; an unknown kind or a wrong field count is a broken
    stream (ConnectionError), never a message half read."""
    try:
        cls = _BY_KIND[raw[0]]
        return cls(*raw[1:])
    except (KeyError, IndexError, TypeError) as exc:
        raise ConnectionError(f"replica worker message {raw[:1]!r} is not one this end knows: {exc}") from None

