"""Work that grows with a request runs in a worker thread once the request is large: one rule for
every caller (an HTTP body's decoding, an aligned request's planning and mapping)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def off_loop_if(large: bool, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` in a worker thread when `large`, else here: a thread hop costs more than
    a small request's whole build, a large one would hold the event loop (gRPC's too)."""
    if large:
        return await asyncio.to_thread(work, *args)
    return work(*args)
