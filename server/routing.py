"""Routing: a key picks a teacher, the teacher picks a replica by least outstanding work.

Scoring is idempotent, so a request whose replica fails is simply scored again on another
one; the failed replica leaves the rotation, is restarted with exponential backoff in the
background, and rejoins once it has started and passed its health check. A teacher with no
healthy replica answers UNAVAILABLE with a retry hint rather than queueing forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from proctor.server.batcher import Batcher
from proctor.server.engines.base import EngineInfo, EngineRequest, EngineResult, TeacherEngine
from proctor.server.errors import Code, ScoringError

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable[TeacherEngine]]


class ReplicaState(str, enum.Enum):
    LOADING = "loading"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    SWAPPED_OUT = "swapped_out"


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
    served: int = 0
    failures: int = 0
    restarts: int = 0
    _restart_task: asyncio.Task | None = field(default=None, repr=False)

    async def start(self) -> None:
        self.state = ReplicaState.LOADING
        engine = await self.factory()
        await engine.start()
        self.engine = engine
        self.batcher = Batcher(engine)
        self.batcher.start()
        self.state = ReplicaState.HEALTHY

    async def stop(self) -> None:
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restart_task
            self._restart_task = None
        if self.batcher is not None:
            await self.batcher.close()
            self.batcher = None
        if self.engine is not None:
            with contextlib.suppress(Exception):
                await self.engine.close()
            self.engine = None

    async def score(self, request: EngineRequest) -> EngineResult:
        if self.batcher is None:
            raise RuntimeError(f"replica {self.replica_id} is not running")
        self.outstanding_tokens += request.num_tokens
        try:
            result = await self.batcher.submit(request)
        finally:
            self.outstanding_tokens -= request.num_tokens
        self.served += 1
        return result


@dataclass
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0


class Teacher:
    """A named teacher: its routing keys and replicas, and the failover around them."""

    def __init__(
        self,
        name: str,
        replicas: list[Replica],
        *,
        keys: tuple[str, ...] = (),
        restart: RestartPolicy | None = None,
        on_replica_state: Callable[[Teacher, Replica], None] | None = None,
    ) -> None:
        if not replicas:
            raise ValueError(f"teacher {name!r} has no replicas")
        self.name = name
        self.replicas = replicas
        self.keys = keys or (name,)
        self.restart_policy = restart or RestartPolicy()
        self._on_replica_state = on_replica_state
        self._info: EngineInfo | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))
        self._info = self.replicas[0].engine.describe()
        for replica in self.replicas:
            self._notify(replica)

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.replicas))

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise ScoringError(Code.UNAVAILABLE, f"teacher {self.name!r} is still loading", retry_after=5.0)
        return self._info

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY]

    def _notify(self, replica: Replica) -> None:
        if self._on_replica_state is not None:
            self._on_replica_state(self, replica)

    # -- routing and failover --------------------------------------------------------------
    def pick(self, exclude: set[str]) -> Replica | None:
        """The healthy replica with the least outstanding tokens (ties: fewest served)."""
        candidates = [r for r in self.healthy() if r.replica_id not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (r.outstanding_tokens, r.served))

    async def score(self, request: EngineRequest) -> EngineResult:
        tried: set[str] = set()
        last_error: Exception | None = None
        while True:
            replica = self.pick(tried)
            if replica is None:
                if last_error is not None and tried and len(tried) >= len(self.replicas):
                    raise ScoringError(
                        Code.UNAVAILABLE,
                        f"teacher {self.name!r}: every replica failed this request ({last_error})",
                        retry_after=self._retry_hint(),
                    )
                raise ScoringError(
                    Code.UNAVAILABLE,
                    f"teacher {self.name!r} has no healthy replica",
                    retry_after=self._retry_hint(),
                )
            tried.add(replica.replica_id)
            try:
                return await replica.score(request)
            except asyncio.CancelledError:
                raise
            except ScoringError:
                raise
            except Exception as exc:
                last_error = exc
                self.mark_failed(replica, exc)

    def _retry_hint(self) -> float:
        return min(self.restart_policy.max_backoff_s, max(1.0, self.restart_policy.initial_backoff_s * 2))

    def mark_failed(self, replica: Replica, error: BaseException) -> None:
        """Take a replica out of rotation and restart it in the background."""
        if replica.state is not ReplicaState.HEALTHY:
            return
        log.warning("teacher %s replica %s failed: %s; restarting", self.name, replica.replica_id, error)
        replica.failures += 1
        replica.state = ReplicaState.UNHEALTHY
        self._notify(replica)
        replica._restart_task = asyncio.get_running_loop().create_task(self._restart(replica))

    async def _restart(self, replica: Replica) -> None:
        backoff = self.restart_policy.initial_backoff_s
        old_batcher, old_engine = replica.batcher, replica.engine
        replica.batcher, replica.engine = None, None
        if old_batcher is not None:
            await old_batcher.close()
        if old_engine is not None:
            with contextlib.suppress(Exception):
                await old_engine.close()
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
                await replica.stop()
                await asyncio.sleep(backoff)
                backoff = min(self.restart_policy.max_backoff_s, backoff * 2)
                continue
            replica.restarts += 1
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
            if not ok:
                self.mark_failed(replica, RuntimeError("health check failed"))


class Router:
    """teacher_key -> Teacher. With one teacher the key is optional; otherwise it is required."""

    def __init__(self, teachers: list[Teacher]) -> None:
        self.teachers = {t.name: t for t in teachers}
        self._by_key: dict[str, Teacher] = {}
        for teacher in teachers:
            for key in teacher.keys:
                if key in self._by_key and self._by_key[key] is not teacher:
                    raise ValueError(f"routing key {key!r} is claimed by two teachers")
                self._by_key[key] = teacher
            self._by_key.setdefault(teacher.name, teacher)

    def route(self, key: str) -> Teacher:
        if not key:
            if len(self.teachers) == 1:
                return next(iter(self.teachers.values()))
            raise ScoringError(
                Code.INVALID_ARGUMENT,
                f"teacher_key: required when the server has several teachers ({', '.join(sorted(self._by_key))})",
                field="teacher_key",
            )
        teacher = self._by_key.get(key)
        if teacher is None:
            raise ScoringError(
                Code.NOT_FOUND,
                f"teacher_key: no teacher for key {key!r} (known: {', '.join(sorted(self._by_key))})",
                field="teacher_key",
            )
        return teacher
