"""A call's work is cancelled the moment its client disconnects, without polling.

The ASGI server tells a handler that its client went away by answering `receive()` with
`http.disconnect`. Once the body has been read, nothing else reads that channel, so one task
can wait on it for the whole call: `cancel_on_disconnect` runs the call's work as a task beside
that listener, and whichever ends first decides. A disconnect cancels the work (the service
then withdraws the call's requests from their queues and counts them `cancelled`) and raises
`ClientGone`, which the endpoint answers with 499, the status a client that left never reads.
This is vLLM's `with_cancellation` (its handlers' bodies are read by FastAPI before they run;
here the body is read first, under its size limit, and only then is the channel listened to).

The previous watcher asked `Request.is_disconnected()` every 50 ms: a wake-up per call per
interval, and up to 50 ms of work for a client that had already gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive

from proctor.server.common.errors import ScoringError

# nginx's status for "client closed request": what a call whose client left is answered.
CLIENT_GONE_STATUS = 499

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its work was cancelled."""


def client_gone() -> Response:
    """The answer to a call whose client left (nobody reads it; it closes the exchange)."""
    return Response(status_code=CLIENT_GONE_STATUS)


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects. After the body, `receive()` blocks until then (an
    empty `http.request` that a server may still hand out is passed over)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, or ClientGone once its work is cancelled because the client left.

    Call it after the body has been read: the listener takes the messages `receive()` hands
    out. When this call itself is cancelled (the server stopping), so is the work."""
    handler = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(request.receive))
    try:
        try:
            await asyncio.wait((handler, listener), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            handler.cancel()
            raise
        finally:
            if not listener.cancel() and not listener.cancelled():
                listener.exception()  # a receive() that failed: the connection is gone all the same
        if handler.done():
            return handler.result()
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError, ScoringError):  # withdrawn before answering 499
            await handler
        raise ClientGone
    finally:
        # `handler.result()` raising puts this frame in the error's traceback; the frame holds the
        # task and the task its error: a cycle that would keep the body and the decoded request
        # (every frame of the work) alive until the cyclic collector runs. Break it here.
        del handler, listener
