"""Moving a teacher to another checkpoint while it serves: replica by replica, each one proven.

An operator points a teacher at another training step (`POST /admin/teachers/{name}/checkpoint`
with a `dist_ckpt_path` or a `model_path`). The step is first made loadable off the event loop
(a Megatron checkpoint converted into its cached folder by `engines.megatron.convert`, the same
conversion `serve` runs at start); nothing is touched if that fails. Then each replica in turn:

1. leaves rotation (RESTARTING: `ReplicaSet.pick` skips it) and finishes what it holds (the
   requests already given to it: its outstanding tokens drain to 0; the others keep serving);
2. is taken down and started on the new folder (`Replica.refactory`, given by the builder);
3. proves the new weights before it takes a request: its fingerprint is the step's (the
   conversion's record, or the folder's digest), its engine answers its health check, the
   teacher's canaries (`drift.canaries`) score finite log-probs on it, equal within `max_drift`
   to the first moved replica's, and it describes the same scoring contract (vocabulary, hidden
   size, lengths, dtype, outputs) the service validates requests against;
4. rejoins (HEALTHY).

A request is scored whole on one replica and each answer carries that replica's fingerprint
(`Replica.score` stamps it), so an answer is never a mix of steps, also after a failover retry
(scored again, whole, on the replica that answers). A replica that fails to load or prove the
step goes back to the old step, with the replicas already moved, and the call says why: the
teacher keeps serving the old step. The teacher's own description (ListTeachers' fingerprint,
its unembedding) becomes the new step's once every replica has moved; the drift check is
paused during the move and starts again with the new step's answers as its first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import weakref
from dataclasses import dataclass, fields
from pathlib import Path

from proctor.server.common.errors import Code, ScoringError, invalid
from proctor.server.engines.base import EngineConfigError, EngineInfo
from proctor.server.front.fleet.drift import DriftSettings, canaries, canary_request
from proctor.server.front.fleet.replicas import EngineFactory, Replica, ReplicaState
from proctor.server.front.fleet.routing import ReplicaSet

log = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.01
# EngineInfo fields that may differ between two steps of one teacher; every other one is the
# contract requests are validated against, so a step that changes it is refused.
_PER_STEP = ("model", "fingerprint", "projection_energy")
_moving: weakref.WeakSet[ReplicaSet] = weakref.WeakSet()
_tasks: set[asyncio.Task] = set()  # the moves under way (held here: the loop keeps weak references)


class StepNotLoaded(RuntimeError):
    """A replica could not load or prove the new step (it is back on the old one)."""


@dataclass(frozen=True)
class MoveReport:
    """What a move did: the step now served and how long it took (the admin call's answer)."""

    teacher: str
    source: str
    folder: str
    fingerprint: str
    previous: str
    step: int | None
    replicas: tuple[str, ...]
    prepare_s: float
    move_s: float
    canary_drift: float

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"replicas": list(self.replicas)}


def _prepare(teacher_set: ReplicaSet, dist_ckpt_path: str | None, model_path: str | None,
             cache_dir: str | None) -> tuple[str, str, int | None]:
    """The folder to load, its fingerprint and step (in a thread: a conversion takes seconds)."""
    from proctor.server.engines.checks import check_model_path
    from proctor.server.engines.fingerprint import model_fingerprint

    if dist_ckpt_path:
        from proctor.server.engines.megatron.convert import materialize

        # The folder served now has the teacher's config.json and tokenizer: the architecture.
        folder = materialize(dist_ckpt_path, teacher_set.tokenizer_path or "", cache_dir)
        record = json.loads((folder / "conversion.json").read_text())
        return str(folder), record.get("fingerprint") or model_fingerprint(folder), record.get("step")
    check_model_path(str(model_path))
    return str(Path(str(model_path))), model_fingerprint(str(model_path)), None


async def move_teacher(teacher_set: ReplicaSet, *, dist_ckpt_path: str | None = None,
                       model_path: str | None = None, cache_dir: str | None = None) -> MoveReport:
    """Point `teacher_set` at another step (exactly one of `dist_ckpt_path`, `model_path`);
    ScoringError (the admin call's answer) when it is refused or does not load."""
    if bool(dist_ckpt_path) == bool(model_path):
        raise invalid("dist_ckpt_path", "give exactly one of dist_ckpt_path or model_path (a non-empty string)")
    fixed = [r.replica_id for r in teacher_set.replicas if r.refactory is None]
    if fixed:
        raise invalid("name", f"teacher {teacher_set.name!r} cannot change weights while serving: replica(s) "
                      f"{', '.join(fixed)} share devices with other teachers (a swap group)")
    if teacher_set in _moving:
        raise ScoringError(Code.UNAVAILABLE, f"teacher {teacher_set.name!r} is already moving to another step",
                           retry_after=5.0)
    # The move runs as a task of its own, shielded: a caller that goes away (an HTTP client's
    # timeout) must not leave a replica half-moved, out of rotation with no engine.
    task = asyncio.get_running_loop().create_task(_move(teacher_set, dist_ckpt_path, model_path, cache_dir),
                                                  name=f"proctor-move-{teacher_set.name}")
    _moving.add(teacher_set)
    _tasks.add(task)
    task.add_done_callback(lambda done: (_moving.discard(teacher_set), _tasks.discard(done)))
    return await asyncio.shield(task)


async def _move(teacher_set: ReplicaSet, dist_ckpt_path: str | None, model_path: str | None,
                cache_dir: str | None) -> MoveReport:
    started = time.perf_counter()
    source = str(dist_ckpt_path or model_path)
    try:
        folder, fingerprint, step = await asyncio.to_thread(_prepare, teacher_set, dist_ckpt_path, model_path,
                                                            cache_dir)
    except EngineConfigError as exc:
        field = "dist_ckpt_path" if dist_ckpt_path else "model_path"
        raise invalid(field, str(exc).removeprefix(f"{field}: ")) from None
    prepared = time.perf_counter()
    old_info = teacher_set.info
    drift = teacher_set.drift
    if drift is not None:
        await drift.stop()
    settings = drift.settings if drift is not None else DriftSettings()
    moved: list[tuple[Replica, EngineFactory]] = []
    reference: dict[int, list[float]] = {}
    worst = 0.0
    try:
        for replica in teacher_set.replicas:
            old_factory = replica.factory
            try:
                worst = max(worst, await _move_replica(teacher_set, replica, replica.refactory(folder), fingerprint,
                                                       old_info, settings, reference))
            except Exception as exc:  # StepNotLoaded, or anything else that broke the move of this replica
                await _return(teacher_set, replica, old_factory)
                for earlier, factory in reversed(moved):
                    await _move_back(teacher_set, earlier, factory)
                raise ScoringError(Code.INTERNAL, f"teacher {teacher_set.name!r}: {source} did not load on replica "
                                   f"{replica.replica_id}: {exc}; the teacher still serves {old_info.fingerprint}") from None
            moved.append((replica, old_factory))
        teacher_set.adopt(teacher_set.replicas[0].engine.describe())
    finally:
        if drift is not None:
            drift.forget_answers()
            drift.start(teacher_set.replicas, lambda: teacher_set.info, teacher_set.supervisor.notify)
    report = MoveReport(teacher_set.name, source, folder, fingerprint, old_info.fingerprint, step,
                        tuple(r.replica_id for r in teacher_set.replicas), round(prepared - started, 3),
                        round(time.perf_counter() - prepared, 3), worst)
    log.info("teacher %s moved to %s (%s): %s", teacher_set.name, source, fingerprint, report)
    return report


async def _leave_rotation(teacher_set: ReplicaSet, replica: Replica) -> None:
    """Out of rotation, its own restart (if one is under way) cancelled, and what it holds finished."""
    await replica.cancel_restart()
    replica.state = ReplicaState.RESTARTING
    teacher_set.supervisor.notify(replica)
    while replica.outstanding_tokens > 0:
        await asyncio.sleep(_DRAIN_POLL_S)
    await replica.take_down()


async def _move_replica(teacher_set: ReplicaSet, replica: Replica, factory: EngineFactory, fingerprint: str,
                        old_info: EngineInfo, settings: DriftSettings, reference: dict[int, list[float]]) -> float:
    """Drain, reload on `factory`, prove, rejoin; the canaries' drift from the first moved replica."""
    await _leave_rotation(teacher_set, replica)
    replica.factory = factory
    try:
        await replica.start()
    except Exception as exc:
        raise StepNotLoaded(f"the engine did not start: {' '.join(str(exc).split())[:300]}") from None
    replica.state = ReplicaState.RESTARTING  # started, not yet proven: no request routed to it
    drift = await _prove(replica, fingerprint, old_info, settings, reference)
    replica.state = ReplicaState.HEALTHY
    teacher_set.supervisor.notify(replica)
    return drift


async def _prove(replica: Replica, fingerprint: str, old_info: EngineInfo, settings: DriftSettings,
                 reference: dict[int, list[float]]) -> float:
    """The new weights are the step's and score as a teacher: fingerprint, health, canaries, contract."""
    if replica.fingerprint != fingerprint:
        raise StepNotLoaded(f"it loaded weights of fingerprint {replica.fingerprint}, not the step's {fingerprint}")
    if not await replica.check_health():
        raise StepNotLoaded("its engine failed its health check")
    info = replica.engine.describe()
    changed = [f.name for f in fields(EngineInfo) if f.name not in _PER_STEP
               and getattr(info, f.name) != getattr(old_info, f.name)]
    if changed:
        raise StepNotLoaded(f"it serves another contract than the old step ({', '.join(changed)} differ)")
    batch = [canary_request(i, ids) for i, ids in enumerate(canaries(settings, info))]
    try:
        outcomes = await replica.engine.score(batch)
    except Exception as exc:
        raise StepNotLoaded(f"its canaries did not score: {exc}") from None
    drift = 0.0
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            raise StepNotLoaded(f"canary {index} did not score: {outcome}")
        values = outcome.logprobs.double().tolist()
        if not all(math.isfinite(v) and v <= 1e-6 for v in values):
            raise StepNotLoaded(f"canary {index} scored log-probs that are not finite and <= 0")
        if index in reference:
            drift = max(drift, max((abs(a - b) for a, b in zip(values, reference[index], strict=True)), default=0.0))
        reference.setdefault(index, values)
    if drift > settings.max_drift:
        raise StepNotLoaded(f"its canaries drift by {drift:.3g} from the first moved replica's "
                            f"(max_drift {settings.max_drift:.3g})")
    return drift


async def _return(teacher_set: ReplicaSet, replica: Replica, old_factory: EngineFactory) -> None:
    """A replica that failed the new step, back on the old one (left to the supervisor if that fails)."""
    await replica.take_down()
    replica.factory = old_factory
    try:
        await replica.start()
    except Exception as exc:
        replica.state = ReplicaState.HEALTHY  # running as far as the supervisor knows: it restarts it
        teacher_set.supervisor.mark_failed(replica, exc)
        return
    teacher_set.supervisor.notify(replica)


async def _move_back(teacher_set: ReplicaSet, replica: Replica, old_factory: EngineFactory) -> None:
    """A replica already on the new step, drained and back on the old one (the move failed later)."""
    await _leave_rotation(teacher_set, replica)
    await _return(teacher_set, replica, old_factory)


