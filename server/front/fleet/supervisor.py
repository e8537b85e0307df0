"""Supervision of a teacher's replicas: taking a failed one out, restarting it, noticing the sick.

A replica error takes the replica out of rotation at once (`mark_failed`); it is restarted in
the background with exponential backoff (`RestartPolicy`) and rejoins once it has started and
passed its health check. A request fault alone does not take a replica out: it starts a
health probe (`probe`), and several different requests that failed on the replica but were
answered elsewhere do (`strike`, the rule of `replica_faults`). A periodic health sweep
catches replicas that die while idle (a lost Ray actor, a crashed engine process) before a
request finds out.

The supervisor acts on replicas only through their methods and public state: it asks a
replica to run its restart (`Replica.schedule_restart`) and its probe (`Replica.start_probe`),
so the replica keeps those tasks and cancels the restart when it stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from proctor.server.common.background import cancel_and_wait
from proctor.server.common.metrics import NULL_SINK, MetricsSink
from proctor.server.engines.base import EngineRequest
from proctor.server.front.fleet.replicas import Replica, ReplicaState

log = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    """How long a failed replica waits before its next restart attempt (doubling each time)."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0


class Supervisor:
    """The failure handling of one teacher's replicas (`teacher`: the teacher's name)."""

    def __init__(self, teacher: str, replicas: list[Replica], policy: RestartPolicy) -> None:
        self.teacher = teacher
        self.replicas = replicas
        self.policy = policy
        self.sink: MetricsSink = NULL_SINK  # set with the replica set's (`ReplicaSet.use_metrics`)
        self._sweeper: asyncio.Task | None = None

    def notify(self, replica: Replica) -> None:
        """Report whether `replica` takes requests now (the per-replica health series)."""
        self.sink.replica_state(self.teacher, replica.replica_id, replica.state is ReplicaState.HEALTHY)

    # -- taking a replica out and bringing it back -------------------------------------------
    def mark_failed(self, replica: Replica, error: BaseException) -> None:
        """Take a running replica (healthy or degraded) out of rotation and restart it in the
        background (once: a replica already out is left to the restart under way)."""
        if not replica.state.running:
            return
        log.warning("teacher %s replica %s failed: %s; restarting", self.teacher, replica.replica_id, error)
        replica.failures += 1
        replica.strikes.clear()
        self.sink.replica_failed(self.teacher, replica.replica_id)
        replica.state = ReplicaState.UNHEALTHY
        self.notify(replica)
        replica.schedule_restart(lambda: self._restart(replica))

    async def _restart(self, replica: Replica) -> None:
        """Take the replica down, then start it until it starts and passes its health check,
        waiting longer after each failed attempt so a device that is gone is not hammered."""
        backoff = self.policy.initial_backoff_s
        await replica.take_down()
        while True:
            replica.state = ReplicaState.RESTARTING
            self.notify(replica)
            started = time.monotonic()
            try:
                await replica.start()
                if replica.engine is not None and not await replica.engine.check_health():
                    raise RuntimeError("health check failed after restart")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("restart of %s/%s failed: %s", self.teacher, replica.replica_id, exc)
                replica.state = ReplicaState.RESTARTING
                await replica.take_down()
                await asyncio.sleep(backoff)
                backoff = min(self.policy.max_backoff_s, backoff * 2)
                continue
            replica.restarts += 1
            self.sink.replica_restarted(self.teacher, replica.replica_id)
            log.info("replica %s/%s back after %.1fs", self.teacher, replica.replica_id, time.monotonic() - started)
            self.notify(replica)
            return

    # -- evidence that a replica is unwell ---------------------------------------------------
    def strike(self, replica: Replica, request: EngineRequest) -> None:
        """A request that failed on `replica` was answered by another one: evidence against it."""
        if replica.strikes.add(request.key) and replica.state.running:
            self.mark_failed(replica, RuntimeError(
                f"{len(replica.strikes)} requests failed on it within {replica.strikes.window_s:.0f} s "
                "that other replicas answered"))

    def probe(self, replica: Replica) -> None:
        """After a request fault: the replica's health probe, in the background (one at a time).

        A probe that fails takes the replica out only if it is still the life that faulted
        (same generation) and still in rotation: a restart since then has already acted.
        """
        generation = replica.generation

        async def probe() -> None:
            ok = await replica.check_health()
            if not ok and replica.generation == generation and replica.state.running:
                self.mark_failed(replica, RuntimeError("health probe failed after a request fault"))

        replica.start_probe(probe)

    async def health_sweep(self) -> None:
        """Check every running replica (healthy or degraded) once; failures go through mark_failed."""
        for replica in [r for r in self.replicas if r.state.running]:
            ok = await replica.check_health()
            if not ok and replica.state.running:
                self.mark_failed(replica, RuntimeError("health check failed"))

    # -- the periodic sweep --------------------------------------------------------------------
    def start_sweeping(self, interval_s: float | None) -> None:
        """Sweep every `interval_s` seconds in the background (none when it is None or 0)."""
        if interval_s and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_forever(interval_s), name=f"proctor-health-{self.teacher}"
            )

    async def stop_sweeping(self) -> None:
        """Stop the periodic sweep (before the replicas stop, so it does not restart them)."""
        await cancel_and_wait(self._sweeper)
        self._sweeper = None

    async def _sweep_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.health_sweep()
            except Exception:  # a sweep must never die: it is what notices dead replicas
                log.exception("health sweep of teacher %s failed", self.teacher)
