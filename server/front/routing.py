"""Routing: a key picks a teacher, the teacher picks a replica by least outstanding work.

Three kinds of error (`server/engines/base.py`): a request error (`RequestRejected`: bad media,
too long for the engine, a processor's refusal) is that request's INVALID_ARGUMENT and never
touches the replica; a request fault (`RequestFailed`: the engine raised on that request alone,
found by splitting its batch, `batch_isolation`) is retried once on another replica and takes
its replica out only when the replica is found unwell; a replica error (`EngineError`: its
process died, its engine is dead) takes the replica out. Scoring is idempotent, so a request
whose replica fails is simply scored again on another one, once (`replica_faults`: failing
twice, it is a poison request); the failed replica leaves the rotation, is restarted with
exponential backoff in the background, and rejoins once it has started and passed its health
check. A teacher with no
healthy replica answers UNAVAILABLE with a retry hint rather than queueing forever.

"In flight" includes the requests still waiting in the failed replica's batcher: closing
the batcher cancels their futures, and `Replica.score` turns that cancellation (which the
caller did not ask for) into `ReplicaLost`, so they are retried like the failed batch.
A periodic health sweep catches replicas that die while idle (a lost Ray actor, a crashed
engine process) before a request finds out.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from proctor.proto import scoring_pb2
from proctor.proto.routing_keys import UnroutableKey, key_table, route_key
from proctor.server.engines.base import (
    EngineInfo,
    EngineRequest,
    EngineResult,
    RequestAborted,
    RequestFailed,
    RequestRejected,
    TeacherEngine,
    describe_fault,
)
from proctor.server.errors import NOT_READY_RETRY_S, Code, ScoringError
from proctor.server.front.batcher import Batcher
from proctor.server.front.replica_faults import RETRIES_AFTER_FAULT, StrikeRecord
from proctor.server.metrics import NULL_SINK, MetricsSink
from proctor.server.prompt_reuse import PromptAffinity, ReuseSettings

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable[TeacherEngine]]
POLICIES = ("least_outstanding", "round_robin")


class ReplicaLost(RuntimeError):
    """The replica went down while the request waited on it; the request was not scored."""


def _caller_cancelled() -> bool:
    """Whether the running task itself is being cancelled (not merely a future it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class ReplicaState(enum.IntEnum):
    """A replica's life (the wire's `ReplicaState`); only HEALTHY replicas take requests."""

    LOADING = scoring_pb2.LOADING
    HEALTHY = scoring_pb2.HEALTHY
    UNHEALTHY = scoring_pb2.UNHEALTHY
    RESTARTING = scoring_pb2.RESTARTING


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
    # Set by the replica set that holds it: the teacher it serves and where it reports events.
    teacher: str = ""
    sink: MetricsSink = field(default=NULL_SINK, repr=False)
    # Requests that failed here and were answered by another replica (`replica_faults`).
    strikes: StrikeRecord = field(default_factory=StrikeRecord, repr=False)
    probe: asyncio.Task | None = field(default=None, repr=False)  # the health probe after a fault
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
        self.state = ReplicaState.LOADING
        engine = await self.factory()
        await engine.start()
        self.engine = engine
        self.batcher = Batcher(engine, sink=self.sink, teacher=self.teacher)
        self.batcher.start()
        self.state = ReplicaState.HEALTHY

    async def stop(self) -> None:
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restart_task
            self._restart_task = None
        await self.take_down()

    async def score(self, request: EngineRequest) -> EngineResult:
        if self.batcher is None:
            raise ReplicaLost(f"replica {self.replica_id} is not running")
        generation = self._generation
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
        self.sink.replica_scored(self.teacher, self.replica_id)
        if result.prompt_reused_tokens is not None:
            self.sink.prompt_reused(self.teacher, result.prompt_reused_tokens)
        return result


def engine_replica(replica_id: str, build: Callable[[], TeacherEngine], **fields: Any) -> Replica:
    """A replica whose engine `build()` makes (called at start and at every restart)."""

    async def factory() -> TeacherEngine:
        return build()

    return Replica(replica_id, factory, **fields)


@dataclass
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0



class ReplicaSet:
    """A named teacher: its routing keys and replicas, and the failover around them.

    `policy` picks a replica: "least_outstanding" (the default) sends each request to the
    healthy replica with the fewest tokens queued or running, so a slow or busy replica
    gets less; "round_robin" cycles through healthy replicas regardless of load (kept for
    comparison: `bench/routing_bench.py`). With several replicas, a request whose prompt was sent to
    a replica recently goes there again unless it is busier than the least loaded by more than a
    batch (`PromptAffinity`: each replica keeps its own shared prompts).
    """

    def __init__(
        self,
        name: str,
        replicas: list[Replica],
        *,
        keys: tuple[str, ...] = (),
        restart: RestartPolicy | None = None,
        policy: str = "least_outstanding",
        health_check_interval_s: float | None = 5.0,
        swap_groups: tuple[Any, ...] = (),
        prompt_reuse: ReuseSettings | None = None,
    ) -> None:
        if not replicas:
            raise ValueError(f"teacher {name!r} has no replicas")
        if policy not in POLICIES:
            raise ValueError(f"teacher {name!r}: policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.name = name
        self.replicas = replicas
        self.keys = keys or (name,)
        self.restart_policy = restart or RestartPolicy()
        self.policy = policy
        self.health_check_interval_s = health_check_interval_s
        self.swap_groups = swap_groups
        self.sink: MetricsSink = NULL_SINK
        self.recent_batch_s = 0.05  # moving average of the engine time of recent batches
        for replica in replicas:
            replica.teacher = name
        self._info: EngineInfo | None = None
        self._rr = 0
        self._sweeper: asyncio.Task | None = None
        reuse = prompt_reuse or ReuseSettings()
        self.affinity = PromptAffinity(reuse) if reuse.enabled and len(replicas) > 1 else None

    def use_metrics(self, sink: MetricsSink) -> None:
        """Report this teacher's events (its replicas', its swap groups') to `sink`."""
        self.sink = sink
        for replica in self.replicas:
            replica.sink = sink
        for group in self.swap_groups:
            group.sink = sink

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))
        self._info = self.replicas[0].engine.describe()
        for replica in self.replicas:
            self._notify(replica)
        if self.health_check_interval_s and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_forever(self.health_check_interval_s), name=f"proctor-health-{self.name}"
            )

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await asyncio.gather(*(r.stop() for r in self.replicas))

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise ScoringError(Code.UNAVAILABLE, f"teacher {self.name!r} is still loading", retry_after=NOT_READY_RETRY_S)
        return self._info

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY]

    def _notify(self, replica: Replica) -> None:
        self.sink.replica_state(self.name, replica.replica_id, replica.state is ReplicaState.HEALTHY)

    # -- routing and failover --------------------------------------------------------------
    def pick(self, exclude: set[str], prefer: str | None = None) -> Replica | None:
        """The next healthy replica by the teacher's policy, skipping those already tried; `prefer`
        (the replica holding the request's prompt) unless it is a batch busier than the least loaded."""
        candidates = [r for r in self.healthy() if r.replica_id not in exclude]
        if not candidates:
            return None
        if self.policy == "round_robin":
            self._rr += 1
            return candidates[self._rr % len(candidates)]
        # Least outstanding tokens; ties go to the replica that has served fewest.
        best = min(candidates, key=lambda r: (r.load, r.served))
        held = next((r for r in candidates if r.replica_id == prefer), None)
        if held is not None and held.engine is not None and held.load <= best.load + held.engine.token_budget():
            return held
        return best

    async def score(self, request: EngineRequest) -> EngineResult:
        """Score on a healthy replica; a failure moves the request to another one, once
        (`replica_faults`: a request failing on two replicas is a poison request)."""
        tried: set[str] = set()
        last_error: Exception | None = None
        faults: list[tuple[Replica, Exception]] = []  # attempts that failed on a replica
        prompt = self.affinity.key(request) if self.affinity is not None else None
        while True:
            replica = self.pick(tried, self.affinity.replica_of(prompt) if prompt is not None else None)
            if replica is None:
                if faults and isinstance(faults[-1][1], RequestFailed):
                    raise ScoringError(Code.INTERNAL, f"teacher {self.name!r}: {faults[-1][1].cause}")
                if last_error is not None:
                    raise ScoringError(
                        Code.UNAVAILABLE,
                        f"teacher {self.name!r}: no healthy replica left to retry this request ({last_error})",
                        retry_after=self.retry_hint(),
                    )
                raise ScoringError(
                    Code.UNAVAILABLE,
                    f"teacher {self.name!r} has no healthy replica",
                    retry_after=self.retry_hint(),
                )
            tried.add(replica.replica_id)
            if prompt is not None:  # the group's next members follow this one (retries move it)
                self.affinity.remember(prompt, replica.replica_id)
            try:
                result = await replica.score(request)
            except (asyncio.CancelledError, ScoringError):
                raise
            except RequestRejected as exc:  # the request's fault: the replica stays in rotation
                raise ScoringError(Code.INVALID_ARGUMENT, exc.message, field=exc.field) from None
            except RequestAborted as exc:
                raise ScoringError(Code.CANCELLED, f"aborted in the engine: {exc}") from None
            except ReplicaLost as exc:  # taken down under us before it ran: nothing to mark
                last_error = exc
                continue
            except RequestFailed as exc:  # this request's fault, or the replica's: not known yet
                last_error = exc
                faults.append((replica, exc))
                replica.sink.request_fault(self.name, replica.replica_id)
                self._probe(replica)
            except Exception as exc:
                last_error = exc
                faults.append((replica, exc))
                self.mark_failed(replica, exc)
            else:
                self.recent_batch_s += 0.1 * (result.engine_seconds - self.recent_batch_s)
                for failed, fault in faults:  # answered here: the request was fine, that replica not
                    if isinstance(fault, RequestFailed):
                        self._strike(failed, request)
                return result
            if len(faults) > RETRIES_AFTER_FAULT:
                raise self._poison(faults)

    def _poison(self, faults: list[tuple[Replica, Exception]]) -> ScoringError:
        """A request that failed on two replicas: counted, failed with both causes, not tried again."""
        self.sink.poison_request(self.name)
        where = " and ".join(replica.replica_id for replica, _ in faults)
        causes = "; ".join(dict.fromkeys(describe_fault(fault) for _, fault in faults))
        log.error("teacher %s: a poison request failed on replicas %s: %s", self.name, where, causes)
        return ScoringError(
            Code.INTERNAL,
            f"teacher {self.name!r}: this request failed on replicas {where} and is not tried again: {causes}",
        )

    def _strike(self, replica: Replica, request: EngineRequest) -> None:
        """A request that failed on `replica` was answered by another one: evidence against it."""
        if replica.strikes.add(request.key) and replica.state is ReplicaState.HEALTHY:
            self.mark_failed(replica, RuntimeError(
                f"{len(replica.strikes)} requests failed on it within {replica.strikes.window_s:.0f} s "
                "that other replicas answered"))

    def _probe(self, replica: Replica) -> None:
        """After a request fault: the replica's health probe, in the background (one at a time)."""
        if replica.probe is not None and not replica.probe.done():
            return
        generation = replica.generation

        async def probe() -> None:
            ok = False
            with contextlib.suppress(Exception):
                ok = replica.engine is not None and await replica.engine.check_health()
            if not ok and replica.generation == generation and replica.state is ReplicaState.HEALTHY:
                self.mark_failed(replica, RuntimeError("health probe failed after a request fault"))

        replica.probe = asyncio.get_running_loop().create_task(probe(), name=f"proctor-probe-{replica.replica_id}")

    def retry_hint(self, admitted_tokens: int = 0) -> float:
        """The one retry hint (seconds) for a refused request of this teacher.

        With healthy replicas: the recent time of one batch (an average over the last results)
        times the batches queued ahead of a new request on each replica (`admitted_tokens`
        over their token budgets), so a client comes back about when its turn would start.
        With none: the next restart attempt's backoff.
        """
        healthy = [r for r in self.healthy() if r.engine is not None]
        if not healthy:
            return min(self.restart_policy.max_backoff_s, max(1.0, self.restart_policy.initial_backoff_s * 2))
        capacity = sum(r.engine.token_budget() for r in healthy)
        ahead = 1.0 + admitted_tokens / max(1, capacity)
        return round(min(30.0, max(0.05, self.recent_batch_s * ahead)), 3)

    def mark_failed(self, replica: Replica, error: BaseException) -> None:
        """Take a replica out of rotation and restart it in the background."""
        if replica.state is not ReplicaState.HEALTHY:
            return
        log.warning("teacher %s replica %s failed: %s; restarting", self.name, replica.replica_id, error)
        replica.failures += 1
        replica.strikes.clear()
        self.sink.replica_failed(self.name, replica.replica_id)
        replica.state = ReplicaState.UNHEALTHY
        self._notify(replica)
        replica._restart_task = asyncio.get_running_loop().create_task(self._restart(replica))

    async def _restart(self, replica: Replica) -> None:
        backoff = self.restart_policy.initial_backoff_s
        await replica.take_down()
        while True:
            replica.state = ReplicaState.RESTARTING
            self._notify(replica)
            started = time.monotonic()
            try:
                await replica.start()
                if replica.engine is not None and not await replica.engine.check_health():
                    raise RuntimeError("health check failed after restart")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("restart of %s/%s failed: %s", self.name, replica.replica_id, exc)
                replica.state = ReplicaState.RESTARTING
                await replica.take_down()
                await asyncio.sleep(backoff)
                backoff = min(self.restart_policy.max_backoff_s, backoff * 2)
                continue
            replica.restarts += 1
            self.sink.replica_restarted(self.name, replica.replica_id)
            replica._restart_task = None
            log.info("replica %s/%s back after %.1fs", self.name, replica.replica_id, time.monotonic() - started)
            self._notify(replica)
            return

    async def health_sweep(self) -> None:
        """Check every healthy replica once; failures go through mark_failed."""
        for replica in self.healthy():
            ok = False
            with contextlib.suppress(Exception):
                ok = replica.engine is not None and await replica.engine.check_health()
            if not ok and replica.state is ReplicaState.HEALTHY:
                self.mark_failed(replica, RuntimeError("health check failed"))

    async def _sweep_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.health_sweep()
            except Exception:  # a sweep must never die: it is what notices dead replicas
                log.exception("health sweep of teacher %s failed", self.name)


class Router:
    """teacher_key -> ReplicaSet. With one teacher the key is optional; otherwise it is required."""

    def __init__(self, teachers: list[ReplicaSet], *, on_close: tuple[Callable[[], None], ...] = ()) -> None:
        self.teachers = {t.name: t for t in teachers}
        # Releases what the replicas were placed on (the Ray pool's placement groups), after
        # every replica has stopped.
        self.on_close = on_close
        self._keys = key_table({t.name: t.keys for t in teachers})

    async def stop(self) -> None:
        """Stop every teacher's replicas, then release their placement."""
        await asyncio.gather(*(t.stop() for t in self.teachers.values()))
        for release in self.on_close:
            try:
                release()
            except Exception:
                log.exception("releasing the replicas' placement failed")

    def use_metrics(self, sink: MetricsSink) -> None:
        """Every teacher reports its events to `sink` (the service's metrics)."""
        for teacher in self.teachers.values():
            teacher.use_metrics(sink)

    def route(self, key: str) -> ReplicaSet:
        """The teacher a request's key selects (the rule of `proctor.proto.routing_keys`)."""
        try:
            return self.teachers[route_key(key, self._keys)]
        except UnroutableKey as exc:
            raise ScoringError(Code[exc.status], exc.message, field="teacher_key") from None
