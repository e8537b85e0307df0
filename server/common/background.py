"""Background tasks owned by a long-lived object (the batcher, the supervisor, a swap group).

Stopping one is always the same three steps: cancel it, wait until it has really finished (so
nothing it does can race the owner's own close), and swallow the CancelledError that this
wait re-raises. One function says so.
"""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` (None: nothing to stop) and return once it has finished."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
