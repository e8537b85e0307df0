"""One replica of a teacher: its engine and batcher, its state, and the tasks that act on it.

A replica goes LOADING -> HEALTHY on `start`; the supervisor (`supervisor`) takes it out
(UNHEALTHY), restarts it (RESTARTING) and brings it back. The replica itself only knows how to
start, be taken down and stop, how to score one request, and which background tasks are its
own (its restart, its health probe): the supervisor hands it those through `schedule_restart`
and `start_probe`, so `stop` can cancel the restart and a second probe is never run alongside
the first.

"In flight" includes the requests still waiting in a failed replica's batcher: closing the
batcher cancels their futures, and `Replica.score` turns that cancellation (which the caller
did not ask for) into `ReplicaLost`, so the router retries them like the failed batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from proctor.proto import scoring_pb2
from proctor.server.common.metrics import NULL_SINK, MetricsSink
from proctor.server.engines.base import EngineRequest, EngineResult, TeacherEngine
from proctor.server.front.fleet.batcher import Batcher
from proctor.server.front.fleet.replica_faults import StrikeRecord

EngineFactory = Callable[[], Awaitable[TeacherEngine]]
# A coroutine the supervisor runs as one of a replica's background tasks.
ReplicaJob = Callable[[], Coroutine[Any, Any, None]]


class ReplicaLost(RuntimeError):
    """The replica went down while the request waited on it; the request was not scored."""


def _caller_cancelled() -> bool:
    """Whether the running task itself is being cancelled (not merely a future it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class ReplicaState(enum.IntEnum):
    """A replica's life (the wire's `ReplicaState`). HEALTHY replicas take requests; a DEGRADED one
    (running, its canaries drifting: `drift`) takes them only while no replica is HEALTHY."""

    LOADING = scoring_pb2.LOADING
    HEALTHY = scoring_pb2.HEALTHY
    UNHEALTHY = scoring_pb2.UNHEALTHY
    RESTARTING = scoring_pb2.RESTARTING
    DEGRADED = scoring_pb2.DEGRADED

    @property
    def running(self) -> bool:
        """Started and answering (HEALTHY or DEGRADED): what failures, probes and sweeps act on."""
        return self in (ReplicaState.HEALTHY, ReplicaState.DEGRADED)


@dataclass
class Replica:
    """One engine instance of a teacher, with its own batcher and load counter."""

    replica_id: str
    factory: EngineFactory
    devices: tuple[str, ...] = ()
    node: str = ""
    engine: TeacherEngine | None = None
    batcher: Batcher | None = None
    state: ReplicaState = ReplicaState.LOADING
    outstanding_tokens: int = 0
    served: int = 0  # results this replica delivered (a request computed twice would show here)
    failures: int = 0
    restarts: int = 0
    # The fingerprint of the weights its engine serves (set at each start); stamped on its answers.
    fingerprint: str = ""
    # The engine factory of this replica on another model folder (`checkpoint_move`); None: its
    # weights cannot be changed while serving (a swap group's teacher).
    refactory: Callable[[str], EngineFactory] | None = field(default=None, repr=False)
    # Set by the replica set that holds it: the teacher it serves and where it reports events.
    teacher: str = ""
    sink: MetricsSink = field(default=NULL_SINK, repr=False)
    # Requests that failed here and were answered by another replica (`replica_faults`).
    strikes: StrikeRecord = field(default_factory=StrikeRecord, repr=False)
    # The health probe after a request fault (`start_probe`) and the restart (`schedule_restart`).
    _probe: asyncio.Task | None = field(default=None, repr=False)
    _restart_task: asyncio.Task | None = field(default=None, repr=False)
    # Bumped whenever the replica is taken down, so a waiter can tell "my replica went away"
    # from "my caller cancelled me".
    _generation: int = field(default=0, repr=False)

    @property
    def generation(self) -> int:
        """Bumped each time the replica is taken down (a probe of an older life is stale)."""
        return self._generation

    @property
    def load(self) -> int:
        """Routing load: outstanding tokens, plus what the engine adds (a shared group's other work)."""
        return self.outstanding_tokens + (self.engine.extra_load() if self.engine is not None else 0)

    async def check_health(self) -> bool:
        """Whether the engine answers its health check now; a check that raises, or no engine,
        counts as a failed check (the probe and the sweep must never raise themselves)."""
        with contextlib.suppress(Exception):
            return self.engine is not None and await self.engine.check_health()
        return False

    async def take_down(self) -> None:
        """Close the batcher (its waiters get ReplicaLost) and the engine; keep the restart task."""
        self._generation += 1
        batcher, engine = self.batcher, self.engine
        self.batcher, self.engine = None, None
        if batcher is not None:
            await batcher.close()
        if engine is not None:
            with contextlib.suppress(Exception):
                await engine.close()

    async def start(self) -> None:
        """Build the engine, start it and its batcher: the replica takes requests once HEALTHY."""
        self.state = ReplicaState.LOADING
        engine = await self.factory()
        await engine.start()
        self.engine = engine
        self.fingerprint = engine.describe().fingerprint
        self.batcher = Batcher(engine, sink=self.sink, teacher=self.teacher)
        self.batcher.start()
        self.state = ReplicaState.HEALTHY

    async def stop(self) -> None:
        """Cancel a restart under way (it would bring the replica back), then take it down."""
        await self.cancel_restart()
        await self.take_down()

    def schedule_restart(self, restart: ReplicaJob) -> None:
        """Run `restart` as this replica's restart task, the one `stop` cancels.

        The slot is cleared when `restart` returns (the replica is back); a restart that is
        cancelled leaves the clearing to `cancel_restart`.
        """

        async def run() -> None:
            await restart()
            self._restart_task = None

        self._restart_task = asyncio.get_running_loop().create_task(run())

    async def cancel_restart(self) -> None:
        """Cancel the restart task, if any, and wait for it to end (its failure is not ours)."""
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restart_task
            self._restart_task = None

    def start_probe(self, probe: ReplicaJob) -> None:
        """Run `probe` in the background unless a probe of this replica is still running: one
        probe answers for every fault that arrives while it runs."""
        if self._probe is not None and not self._probe.done():
            return
        self._probe = asyncio.get_running_loop().create_task(probe(), name=f"proctor-probe-{self.replica_id}")

    async def score(self, request: EngineRequest) -> EngineResult:
        """Score one request through the batcher, counting its tokens as this replica's load."""
        if self.batcher is None:
            raise ReplicaLost(f"replica {self.replica_id} is not running")
        generation, fingerprint = self._generation, self.fingerprint
        self.outstanding_tokens += request.num_tokens
        try:
            result = await self.batcher.submit(request)
        except asyncio.CancelledError:
            if generation != self._generation and not _caller_cancelled():
                raise ReplicaLost(f"replica {self.replica_id} went down with the request queued") from None
            raise
        finally:
            self.outstanding_tokens -= request.num_tokens
        self.served += 1
        result.fingerprint = fingerprint
        self.sink.replica_scored(self.teacher, self.replica_id)
        if result.prompt_reused_tokens is not None:
            self.sink.prompt_reused(self.teacher, result.prompt_reused_tokens)
        if result.computed_tokens is not None:
            self.sink.engine_computed(self.teacher, result.computed_tokens)
        return result


def engine_factory(build: Callable[[], TeacherEngine]) -> EngineFactory:
    """The factory of engines that `build()` makes (called at start and at every restart)."""

    async def factory() -> TeacherEngine:
        return build()

    return factory


def engine_replica(replica_id: str, build: Callable[[], TeacherEngine], **fields: Any) -> Replica:
    """A replica whose engine `build()` makes (called at start and at every restart)."""
    return Replica(replica_id, engine_factory(build), **fields)
