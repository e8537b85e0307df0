"""Routing: a key picks a teacher, the teacher picks a replica by least outstanding work.

Three kinds of error (`server/engines/base.py`): a request error (`RequestRejected`: bad media,
too long for the engine, a processor's refusal) is that request's INVALID_ARGUMENT and never
touches the replica; a request fault (`RequestFailed`: the engine raised on that request alone,
found by splitting its batch, `batch_isolation`) is retried once on another replica and takes
its replica out only when the replica is found unwell; a replica error (`EngineError`: its
process died, its engine is dead) takes the replica out. Scoring is idempotent, so a request
whose replica fails is simply scored again on another one, once (`replica_faults`: failing
twice, it is a poison request). A teacher with no healthy replica answers UNAVAILABLE with a
retry hint rather than queueing forever.

This module owns the choice and the retry; what a replica is and how it starts and stops is
`replicas`, and taking a failed one out, restarting it with backoff, probing and sweeping for
sick ones is `supervisor`. Their names are re-exported here, where the transports, the config
builder and the tests import them from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from proctor.proto.routing_keys import UnroutableKey, key_table, route_key
from proctor.server.common.errors import NOT_READY_RETRY_S, Code, ScoringError
from proctor.server.common.metrics import NULL_SINK, MetricsSink
from proctor.server.engines.base import (
    EngineInfo,
    EngineRequest,
    EngineResult,
    RequestAborted,
    RequestFailed,
    RequestRejected,
)
from proctor.server.engines.faults import describe_fault
from proctor.server.engines.prompt_reuse import PromptAffinity, ReuseSettings
from proctor.server.front.fleet.drift import DriftCheck, DriftSettings
from proctor.server.front.fleet.replica_faults import RETRIES_AFTER_FAULT
from proctor.server.front.fleet.replicas import (
    EngineFactory,
    Replica,
    ReplicaLost,
    ReplicaState,
    engine_replica,
)
from proctor.server.front.fleet.supervisor import RestartPolicy, Supervisor

__all__ = [
    "POLICIES",
    "EngineFactory",
    "Replica",
    "ReplicaLost",
    "ReplicaSet",
    "ReplicaState",
    "RestartPolicy",
    "Router",
    "engine_replica",
]

log = logging.getLogger(__name__)

POLICIES = ("least_outstanding", "round_robin")


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
        tokenizer_path: str | None = None,
        drift: DriftSettings | None = None,
    ) -> None:
        if not replicas:
            raise ValueError(f"teacher {name!r} has no replicas")
        if policy not in POLICIES:
            raise ValueError(f"teacher {name!r}: policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.name = name
        # Where the teacher's tokenizer is read from (its model directory, from the serving plan):
        # the front tokenizes text prompts and decodes tokens for vLLM's surface with it.
        self.tokenizer_path = tokenizer_path
        self.replicas = replicas
        self.keys = keys or (name,)
        self.supervisor = Supervisor(name, replicas, restart or RestartPolicy())
        self.policy = policy
        self.health_check_interval_s = health_check_interval_s
        self.swap_groups = swap_groups
        self.sink: MetricsSink = NULL_SINK
        self.recent_batch_s = 0.05  # moving average of the engine time of recent batches
        for replica in replicas:
            replica.teacher = name
        self._info: EngineInfo | None = None
        self._rr = 0
        reuse = prompt_reuse or ReuseSettings()
        self.affinity = PromptAffinity(reuse) if reuse.enabled and len(replicas) > 1 else None
        # The replicas' canary check (`drift`); None: not checked.
        self.drift = DriftCheck(name, drift) if drift is not None and drift.enabled else None

    @property
    def restart_policy(self) -> RestartPolicy:
        """The backoff of this teacher's restarts (the supervisor's, which applies it)."""
        return self.supervisor.policy

    @restart_policy.setter
    def restart_policy(self, policy: RestartPolicy) -> None:
        self.supervisor.policy = policy

    def use_metrics(self, sink: MetricsSink) -> None:
        """Report this teacher's events (its replicas', its swap groups') to `sink`."""
        self.sink = sink
        self.supervisor.sink = sink
        for replica in self.replicas:
            replica.sink = sink
        for group in self.swap_groups:
            group.sink = sink
        if self.drift is not None:
            self.drift.sink = sink

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every replica; the teacher's description is the first replica's engine's."""
        await asyncio.gather(*(r.start() for r in self.replicas))
        self._info = self.replicas[0].engine.describe()
        for replica in self.replicas:
            self.supervisor.notify(replica)
        self.supervisor.start_sweeping(self.health_check_interval_s)
        if self.drift is not None:
            self.drift.start(self.replicas, lambda: self.info, self.supervisor.notify)

    async def stop(self) -> None:
        """Stop the sweep and the drift check first (so they touch nothing), then every replica."""
        await self.supervisor.stop_sweeping()
        if self.drift is not None:
            await self.drift.stop()
        await asyncio.gather(*(r.stop() for r in self.replicas))

    @property
    def info(self) -> EngineInfo:
        """What the teacher's engine scores (UNAVAILABLE until the first start has finished)."""
        if self._info is None:
            raise ScoringError(Code.UNAVAILABLE, f"teacher {self.name!r} is still loading", retry_after=NOT_READY_RETRY_S)
        return self._info

    def adopt(self, info: EngineInfo) -> None:
        """What the teacher serves from now on: every replica moved to another step (`checkpoint_move`)."""
        self._info = info

    def healthy(self) -> list[Replica]:
        """The HEALTHY replicas."""
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY]

    def in_service(self) -> list[Replica]:
        """The replicas in rotation now: the HEALTHY ones, else the DEGRADED ones (drifting, but
        still the teacher's best answer)."""
        return self.healthy() or [r for r in self.replicas if r.state is ReplicaState.DEGRADED]

    def mark_failed(self, replica: Replica, error: BaseException) -> None:
        """Take a replica out of rotation and restart it in the background (`Supervisor`)."""
        self.supervisor.mark_failed(replica, error)

    async def health_sweep(self) -> None:
        """Check every healthy replica once; failures go through mark_failed."""
        await self.supervisor.health_sweep()

    # -- routing and failover --------------------------------------------------------------
    def pick(self, exclude: set[str], prefer: str | None = None, pinned: str | None = None) -> Replica | None:
        """The next healthy replica by the teacher's policy, skipping those already tried (a degraded
        one only when no healthy one is left); `prefer` (the replica holding the request's prompt)
        unless it is a batch busier than the least loaded. `pinned`: that replica alone, if running."""
        if pinned is not None:
            return next((r for r in self.replicas if r.replica_id == pinned and r.state.running
                         and pinned not in exclude), None)
        running = [r for r in self.replicas if r.state.running and r.replica_id not in exclude]
        candidates = [r for r in running if r.state is ReplicaState.HEALTHY] or running
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

    async def score(self, request: EngineRequest, *, replica_id: str | None = None) -> EngineResult:
        """Score on a healthy replica; a failure moves the request to another one, once
        (`replica_faults`: a request failing on two replicas is a poison request). `replica_id`
        pins it to that replica (validated by the service), with no failover."""
        tried: set[str] = set()
        last_error: Exception | None = None
        faults: list[tuple[Replica, Exception]] = []  # attempts that failed on a replica
        pinned = replica_id is not None
        prompt = self.affinity.key(request) if self.affinity is not None and not pinned else None
        while True:
            replica = self.pick(tried, self.affinity.replica_of(prompt) if prompt is not None else None, replica_id)
            if replica is None:
                raise self._nowhere_left(faults, last_error, replica_id)
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
                self.supervisor.probe(replica)
            except Exception as exc:
                last_error = exc
                faults.append((replica, exc))
                self.mark_failed(replica, exc)
            else:
                self.recent_batch_s += 0.1 * (result.engine_seconds - self.recent_batch_s)
                for failed, fault in faults:  # answered here: the request was fine, that replica not
                    if isinstance(fault, RequestFailed):
                        self.supervisor.strike(failed, request)
                return result
            if len(faults) > RETRIES_AFTER_FAULT:
                raise self._poison(faults)

    def _nowhere_left(self, faults: list[tuple[Replica, Exception]], last_error: Exception | None,
                      pinned: str | None = None) -> ScoringError:
        """The error for a request with no healthy replica left to try: the request's own fault
        if that is what the last attempt hit, else UNAVAILABLE with the retry hint."""
        if faults and isinstance(faults[-1][1], RequestFailed):
            return ScoringError(Code.INTERNAL, f"teacher {self.name!r}: {faults[-1][1].cause}")
        if pinned is not None:
            state = next(r.state for r in self.replicas if r.replica_id == pinned).name
            cause = f" ({last_error})" if last_error is not None else ""
            return ScoringError(Code.UNAVAILABLE, f"teacher {self.name!r}: replica {pinned!r} (the request's "
                                f"replica) is {state} and did not score it{cause}", retry_after=self.retry_hint())
        if last_error is not None:
            return ScoringError(
                Code.UNAVAILABLE,
                f"teacher {self.name!r}: no healthy replica left to retry this request ({last_error})",
                retry_after=self.retry_hint(),
            )
        return ScoringError(
            Code.UNAVAILABLE,
            f"teacher {self.name!r} has no healthy replica",
            retry_after=self.retry_hint(),
        )

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

    def retry_hint(self, admitted_tokens: int = 0) -> float:
        """The one retry hint (seconds) for a refused request of this teacher.

        With healthy replicas: the recent time of one batch (an average over the last results)
        times the batches queued ahead of a new request on each replica (`admitted_tokens`
        over their token budgets), so a client comes back about when its turn would start.
        With none: the next restart attempt's backoff.
        """
        healthy = [r for r in self.in_service() if r.engine is not None]
        if not healthy:
            return min(self.restart_policy.max_backoff_s, max(1.0, self.restart_policy.initial_backoff_s * 2))
        capacity = sum(r.engine.token_budget() for r in healthy)
        ahead = 1.0 + admitted_tokens / max(1, capacity)
        return round(min(30.0, max(0.05, self.recent_batch_s * ahead)), 3)


class Router:
    """teacher_key -> ReplicaSet. With one teacher the key is optional; otherwise it is required."""

    def __init__(self, teachers: list[ReplicaSet], *, on_close: tuple[Callable[[], None], ...] = ()) -> None:
        self.teachers = {teacher_set.name: teacher_set for teacher_set in teachers}
        # Releases what the replicas were placed on (the Ray pool's placement groups), after
        # every replica has stopped.
        self.on_close = on_close
        self._keys = key_table({teacher_set.name: teacher_set.keys for teacher_set in teachers})

    async def stop(self) -> None:
        """Stop every teacher's replicas, then release their placement."""
        await asyncio.gather(*(teacher_set.stop() for teacher_set in self.teachers.values()))
        for release in self.on_close:
            try:
                release()
            except Exception:
                log.exception("releasing the replicas' placement failed")

    def use_metrics(self, sink: MetricsSink) -> None:
        """Every teacher reports its events to `sink` (the service's metrics)."""
        for teacher_set in self.teachers.values():
            teacher_set.use_metrics(sink)

    def route(self, key: str) -> ReplicaSet:
        """The teacher a request's key selects (the rule of `proctor.proto.routing_keys`)."""
        try:
            return self.teachers[route_key(key, self._keys)]
        except UnroutableKey as exc:
            raise ScoringError(Code[exc.status], exc.message, field="teacher_key") from None
