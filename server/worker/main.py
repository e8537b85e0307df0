"""A replica worker: one teacher engine in a process of its own (`python -m proctor.server.worker.main FD [ARENA_FD]`).

The server's front process starts one per replica (`WorkerClient`), whatever the engine,
with the replica's environment given explicitly (its `*_VISIBLE_DEVICES`), so the engine's own
processes (vLLM's EngineCore and workers) inherit exactly that and nothing another replica
set; replicas start concurrently and the front's `os.environ` is never touched. The worker
owns everything per token: its engine (vLLM's output processing, the torch forward pass and its
Python) and the encoding of each result into the wire's bytes (`worker.wire`), so the front
only moves bytes. It serves the engine protocol over the socket `FD` (see `worker.protocol`):
scoring calls run concurrently, aborts reach the engine while its batch runs, and health
checks are answered by the engine's own probe. The large buffers of its replies go through
the shared arena the front passed it (`worker.arena`), when there is one. When the front goes
away (the socket closes) the worker closes its engine and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from typing import Any

from proctor.server.engines.base import EngineError
from proctor.server.engines.faults import describe_fault, is_out_of_memory
from proctor.server.worker import messages
from proctor.server.worker.protocol import Channel
from proctor.server.worker.wire import encode_outcomes

log = logging.getLogger(__name__)


class EngineHost:
    """Answers the server's messages with one engine."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.engine: Any = None
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        message = await self.channel.receive()
        if not isinstance(message, messages.Start) or not await self._start(message.spec, message.build):
            return
        try:
            while (message := await self.channel.receive()) is not None and not isinstance(message, messages.Close):
                self._dispatch(message)
        finally:
            for task in list(self._tasks):
                task.cancel()
            if self.engine is not None:
                with contextlib.suppress(Exception):
                    await self.engine.close()

    async def _start(self, spec: Any, build: Any) -> bool:
        from proctor.server.engines.factory import create_engine

        try:
            self.engine = (build or create_engine)(spec)
            await self.engine.start()
        except Exception as exc:
            log.exception("engine failed to start")
            await self._send(messages.StartFailed(f"{type(exc).__name__}: {exc}"))
            return False
        await self._send(messages.Ready(self.engine.describe(), self.engine.token_budget()))
        return True

    def _dispatch(self, message: messages.Message) -> None:
        """The one place the worker acts on a front message, by its kind."""
        match message:
            case messages.Free(offsets):  # the front is done with these blocks of the shared arena
                if self.channel.arena_out is not None:
                    self.channel.arena_out.free(offsets)
            case messages.Abort(keys):
                self._spawn(self.engine.abort(list(keys)))
            case messages.Score(call, batch):
                self._spawn(self._reply(call, self._score(batch)))
            case messages.Health(call):
                self._spawn(self._reply(call, self.engine.check_health()))
            case messages.Unembedding(call):  # the model's own output embedding, read off this loop
                self._spawn(self._reply(call, asyncio.to_thread(self.engine.unembedding)))
            case _:
                log.error("message %s is not one the front sends", type(message).__name__)

    async def _score(self, batch: list) -> list:
        return encode_outcomes(await self.engine.score(batch))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, call: int, coro) -> None:
        """Answer a call: its value (`Reply`); `Failed` when the engine says the replica is unwell
        (`EngineError`); `Raised` when it raised anything else (the batch's fault, or one of its
        requests': the front splits the batch to find which), with its traceback logged here."""
        try:
            value = await coro
        except asyncio.CancelledError:
            raise
        except EngineError as exc:
            await self._send(messages.Failed(call, f"{type(exc).__name__}: {exc}"))
            return
        except Exception as exc:
            log.exception("the engine raised on call %d", call)
            await self._send(messages.Raised(call, describe_fault(exc), is_out_of_memory(exc)))
            return
        await self._send(messages.Reply(call, value))

    async def _send(self, message: messages.Message) -> None:
        self.channel.send(message)
        await self.channel.drain()


async def _main(fd: int, arena_fd: int | None) -> None:
    sock = socket.socket(fileno=fd)
    channel = await Channel.open(sock)
    if arena_fd is not None:
        channel.use_arena_for_sending(arena_fd)
    await EngineHost(channel).serve()
    channel.close()


def main() -> None:
    from proctor.server.common.malloc_tuning import keep_large_buffers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_large_buffers()  # results' buffers reused, not re-faulted (`malloc_tuning`)
    asyncio.run(_main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None))


if __name__ == "__main__":
    main()
