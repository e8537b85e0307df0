"""Dynamic batching in front of one engine replica.

Requests that arrive while the engine is busy wait in a queue; when the engine is free the
batcher takes as many as fit the engine's token budget and scores them in one call. Under
load this turns many small requests into few large forward passes; when idle, a lone
request goes straight through (no timer to wait for). A request cancelled while waiting is
dropped before it costs any compute; one cancelled while its batch runs is aborted in the
engine (`TeacherEngine.abort`), so a caller that gives up (or whose deadline passes) stops
costing compute there too.

The engine answers one outcome per request: a result, or an exception for that request alone
(a request error, an abort, a server fault of that request, or a replica error that hit it);
each caller gets its own. A batch the engine raises on is split until the request at fault
stands alone (`batch_isolation`), so its batch-mates are answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from proctor.server.common.background import cancel_and_wait
from proctor.server.common.metrics import NULL_SINK, MetricsSink
from proctor.server.engines.base import EngineRequest, EngineResult, TeacherEngine
from proctor.server.front.fleet.batch_isolation import score_isolating

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: EngineRequest
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    queued_at: float = field(default_factory=time.monotonic)


class Batcher:
    """Feeds one engine with batches bounded by its token budget."""

    def __init__(
        self, engine: TeacherEngine, *, max_batch_requests: int = 256, sink: MetricsSink = NULL_SINK, teacher: str = ""
    ) -> None:
        self.engine = engine
        self.sink = sink
        self.teacher = teacher
        self.max_batch_requests = max_batch_requests
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.running_requests = 0
        self._running: set[str] = set()  # keys of the requests in the batch being scored
        self.aborts_sent = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="proctor-batcher")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for pending in self._queue:
            if not pending.future.done():
                pending.future.cancel()
        self.sink.queue_changed(self.teacher, waiting=-len(self._queue))
        self._queue.clear()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def submit(self, request: EngineRequest) -> EngineResult:
        """Queue a request and wait for its result (cancelling the wait withdraws it)."""
        self.start()
        pending = _Pending(request)
        self._queue.append(pending)
        self.sink.queue_changed(self.teacher, waiting=1)
        self._wakeup.set()
        try:  # a cancelled wait cancels the future too: the batch then skips this request
            return await pending.future
        except asyncio.CancelledError:
            if not pending.future.done():
                pending.future.cancel()
            if request.key in self._running:
                self._abort(request.key)
            raise

    def _abort(self, key: str) -> None:
        self.aborts_sent += 1
        task = asyncio.get_running_loop().create_task(self.engine.abort([key]))
        task.add_done_callback(_log_abort_failure)

    def _take_batch(self) -> list[_Pending]:
        budget = self.engine.token_budget()
        batch: list[_Pending] = []
        tokens = 0
        keep: list[_Pending] = []
        for pending in self._queue:
            if pending.future.done():  # cancelled while waiting
                continue
            size = pending.request.num_tokens
            fits = not batch or (tokens + size <= budget and len(batch) < self.max_batch_requests)
            if fits and not keep:
                batch.append(pending)
                tokens += size
            else:
                keep.append(pending)
        self.sink.queue_changed(self.teacher, waiting=len(keep) - len(self._queue), running=len(batch))
        self._queue = keep
        return batch

    async def _loop(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            batch = self._take_batch()
            if batch:
                await self._run(batch)
            del batch  # nothing of a scored batch outlives it here (its answers may hold shared memory)

    async def _run(self, batch: list[_Pending]) -> None:
        """Score one batch and hand each caller its outcome."""
        self.batches += 1
        self.running_requests = len(batch)
        self._running = {p.request.key for p in batch}
        started = time.monotonic()
        waiting = {p.request.key: p.future for p in batch}
        try:
            results = await score_isolating(
                self.engine, [p.request for p in batch], lambda request: not waiting[request.key].done()
            )
        except asyncio.CancelledError:
            for pending in batch:
                if not pending.future.done():
                    pending.future.cancel()
            raise
        except Exception as exc:  # the replica failed (`EngineError`): every caller hears why
            log.warning("replica failed a batch of %d: %s", len(batch), exc)
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(exc)
        else:
            engine_seconds = time.monotonic() - started
            for pending, outcome in zip(batch, results, strict=True):
                if pending.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    pending.future.set_exception(outcome)
                    continue
                outcome.queue_seconds = started - pending.queued_at
                outcome.engine_seconds = engine_seconds
                pending.future.set_result(outcome)
        finally:
            self.running_requests = 0
            self._running = set()
            self.sink.queue_changed(self.teacher, running=-len(batch))


def _log_abort_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("engine abort failed: %s", task.exception())
