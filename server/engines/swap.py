"""Teachers that share devices: one model on the device, the others' weights in CPU memory.

When the pool has fewer replica slots than teachers of one architecture (LoongSage's case:
many domain experts fine-tuned from one base), a slot becomes a *swap group*: its device
holds one teacher's weights at a time; every teacher's weights wait in (pinned, where a
device can use it) CPU memory and are copied onto the device in place (`copy_` through
`load_state_dict`), so no allocation happens on the device after start.

A swap costs a full weight copy, so the group schedules batches per teacher: while the
resident teacher has batches waiting it keeps the device, up to `max_consecutive_batches`
while another teacher waits (so that a busy teacher cannot starve the others); then the
teacher whose oldest batch has waited longest is swapped in. Each teacher sees the group
through a `SwappedTeacherEngine`, an ordinary engine behind an ordinary `Replica`, so
routing, batching and failover do not know about swapping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from proctor.server.common.background import cancel_and_wait
from proctor.server.common.metrics import NULL_SINK, MetricsSink
from proctor.server.engines.base import (
    DEFAULT_TOKEN_BUDGET,
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineResult,
    EngineSpec,
    TeacherEngine,
)
from proctor.server.engines.torch.engine import TorchEngine

log = logging.getLogger(__name__)

# Tokens a non-resident teacher's request is charged when routing picks a replica: a swap
# costs about as much as scoring this many tokens on a small model (a hint, not a measure).
SWAP_COST_TOKENS = 4096


@dataclass
class _StoredTeacher:
    """One teacher's weights in CPU memory and the facts its engine reported."""

    info: EngineInfo
    state: dict[str, torch.Tensor]
    unembedding_key: str


@dataclass
class _Job:
    teacher: str
    batch: list[EngineRequest]
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return sum(r.num_tokens for r in self.batch)


class SwapGroup:
    """Several teachers of one architecture taking turns on one set of devices."""

    def __init__(
        self,
        group_id: str,
        specs: dict[str, EngineSpec],
        *,
        max_consecutive_batches: int = 4,
    ) -> None:
        if len(specs) < 2:
            raise ValueError(f"swap group {group_id}: needs at least two teachers, got {list(specs)}")
        if any(spec.name != "torch" for spec in specs.values()):
            raise ValueError(f"swap group {group_id}: weight swapping is implemented for the torch engine only")
        if max_consecutive_batches < 1:
            raise ValueError("max_consecutive_batches must be at least 1")
        self.group_id = group_id
        self.specs = specs
        self.max_consecutive_batches = max_consecutive_batches
        self.sink: MetricsSink = NULL_SINK  # set by the replica sets that use the group
        self.resident: str | None = None
        self.swaps: dict[str, int] = {name: 0 for name in specs}
        self.batches_run: list[str] = []  # teacher of every batch, in order (observable scheduling)
        self._stored: dict[str, _StoredTeacher] = {}
        self._engine: TorchEngine | None = None
        self._queues: dict[str, deque[_Job]] = {name: deque() for name in specs}
        self._outstanding: dict[str, int] = {name: 0 for name in specs}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._users = 0
        self._lock = asyncio.Lock()
        self.healthy = False

    # -- lifecycle (reference-counted: every teacher's replica starts and closes its view) ------
    async def acquire(self) -> None:
        async with self._lock:
            if self._users == 0:
                await self._load()
            self._users += 1

    async def release(self) -> None:
        async with self._lock:
            self._users = max(0, self._users - 1)
            if self._users == 0:
                await self._unload()

    async def _load(self) -> None:
        pin = torch.cuda.is_available()
        first = next(iter(self.specs))
        for name, spec in self.specs.items():
            # Load on the CPU: the weights stay there; only the resident teacher's go to the device.
            loader = TorchEngine(replace(spec, device="cpu"))
            await loader.start()
            module = loader.module
            head = module.get_output_embeddings().weight
            state = module.state_dict()
            key = next(k for k, v in state.items() if v.data_ptr() == head.data_ptr())
            if pin:
                state = {k: v.pin_memory() for k, v in state.items()}
            self._stored[name] = _StoredTeacher(loader.describe(), state, key)
            await loader.close()
        self._check_compatible()
        engine = TorchEngine(self.specs[first])
        await engine.start()
        self._engine = engine
        self.resident = first
        self.healthy = True
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"proctor-swap-{self.group_id}")
        log.info("swap group %s: %s resident, %s in CPU memory", self.group_id, first,
                 ", ".join(n for n in self.specs if n != first))

    def _check_compatible(self) -> None:
        names = list(self._stored)
        reference = {k: (v.shape, v.dtype) for k, v in self._stored[names[0]].state.items()}
        for name in names[1:]:
            shapes = {k: (v.shape, v.dtype) for k, v in self._stored[name].state.items()}
            if shapes != reference:
                raise EngineError(
                    f"swap group {self.group_id}: teachers {names[0]!r} and {name!r} have different weight "
                    "shapes or dtypes and cannot share devices; give them their own devices (num_replicas)"
                )

    async def _unload(self) -> None:
        self.healthy = False
        await cancel_and_wait(self._task)
        self._task = None
        for queue in self._queues.values():
            while queue:
                job = queue.popleft()
                if not job.future.done():
                    job.future.set_exception(EngineError(f"swap group {self.group_id} closed"))
        if self._engine is not None:
            await self._engine.close()
            self._engine = None
        self._stored.clear()
        self.resident = None

    # -- what each teacher's view needs ------------------------------------------------------
    def info(self, teacher: str) -> EngineInfo:
        stored = self._stored.get(teacher)
        if stored is None:
            raise EngineError(f"swap group {self.group_id} is not loaded")
        return stored.info

    def unembedding(self, teacher: str) -> torch.Tensor:
        stored = self._stored.get(teacher)
        if stored is None:
            raise EngineError(f"swap group {self.group_id} is not loaded")
        return stored.state[stored.unembedding_key]

    def token_budget(self) -> int:
        return self._engine.token_budget() if self._engine is not None else DEFAULT_TOKEN_BUDGET

    def foreign_load(self, teacher: str) -> int:
        """Tokens queued here for other teachers, plus a swap's cost if `teacher` is not resident."""
        others = sum(tokens for name, tokens in self._outstanding.items() if name != teacher)
        return others + (0 if self.resident == teacher else SWAP_COST_TOKENS)

    async def score(self, teacher: str, batch: list[EngineRequest]) -> list[EngineResult]:
        if not self.healthy:
            raise EngineError(f"swap group {self.group_id} is not running")
        job = _Job(teacher, batch, asyncio.get_running_loop().create_future())
        self._queues[teacher].append(job)
        self._outstanding[teacher] += job.tokens
        self._wakeup.set()
        try:
            return await job.future
        finally:
            self._outstanding[teacher] -= job.tokens

    # -- the scheduler -----------------------------------------------------------------------
    def _next_job(self, consecutive: int) -> _Job | None:
        waiting = {name: q for name, q in self._queues.items() if q}
        if not waiting:
            return None
        resident = self.resident
        others_wait = any(name != resident for name in waiting)
        if resident in waiting and (not others_wait or consecutive < self.max_consecutive_batches):
            return waiting[resident].popleft()
        # Swap to the teacher that has waited longest (not the resident one, whose turn is over).
        candidates = {n: q for n, q in waiting.items() if n != resident} or waiting
        name = min(candidates, key=lambda n: candidates[n][0].queued_at)
        return candidates[name].popleft()

    async def _run(self) -> None:
        consecutive = 0
        while True:
            job = self._next_job(consecutive)
            if job is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if job.future.done():  # the caller gave up while waiting
                continue
            try:
                if job.teacher != self.resident:
                    await asyncio.to_thread(self._swap_in, job.teacher)
                    consecutive = 0
                consecutive += 1
                self.batches_run.append(job.teacher)
                results = await self._engine.score(job.batch)
            except asyncio.CancelledError:
                if not job.future.done():
                    job.future.set_exception(EngineError(f"swap group {self.group_id} closed"))
                raise
            except Exception as exc:
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(results)
            # Let the resident teacher's batcher hand in its next batch before choosing whom to run,
            # so that its queue is drained before a swap (its batcher reacts one loop turn later).
            for _ in range(3):
                await asyncio.sleep(0)

    def _swap_in(self, teacher: str) -> None:
        """Copy a teacher's CPU weights onto the device model, in place."""
        started = time.monotonic()
        module = self._engine.module
        with torch.no_grad():
            module.load_state_dict(self._stored[teacher].state, strict=True)
        previous, self.resident = self.resident, teacher
        self.swaps[teacher] += 1
        self.sink.teacher_swapped(teacher)
        log.info("swap group %s: %s -> %s in %.3fs", self.group_id, previous, teacher, time.monotonic() - started)


class SwappedTeacherEngine(TeacherEngine):
    """One teacher's view of a swap group: what its replica scores through."""

    def __init__(self, group: SwapGroup, teacher: str) -> None:
        if teacher not in group.specs:
            raise ValueError(f"teacher {teacher!r} is not in swap group {group.group_id}")
        self.group = group
        self.teacher = teacher
        self._started = False

    async def start(self) -> None:
        await self.group.acquire()
        self._started = True

    async def close(self) -> None:
        if self._started:
            self._started = False
            await self.group.release()

    def describe(self) -> EngineInfo:
        return self.group.info(self.teacher)

    def token_budget(self) -> int:
        return self.group.token_budget()

    def unembedding(self) -> torch.Tensor:
        return self.group.unembedding(self.teacher)

    async def score(self, batch: list[EngineRequest]) -> list[EngineResult]:
        return await self.group.score(self.teacher, batch)

    async def check_health(self) -> bool:
        return self._started and self.group.healthy

    def extra_load(self) -> int:
        """Routing hint (see `Replica.load`): the group's other work and the cost of a swap."""
        return self.group.foreign_load(self.teacher)

    @property
    def resident(self) -> bool:
        return self.group.resident == self.teacher
