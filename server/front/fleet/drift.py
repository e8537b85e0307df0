"""The drift check: do a teacher's replicas still compute what the teacher first computed?

Replicas of one teacher can disagree: different devices, a corrupted or wrongly loaded copy of the
weights, a driver or kernel change after a restart, and for a teacher that is not batch-invariant,
the batch a sequence landed in. Every `interval_s` each running replica scores the teacher's fixed
canaries (`canaries` sequences of `canary_tokens` token ids, the same ids at every check); once the
round is done the front compares each replica's log-probs with the *majority's*: the answers that
agree (within `max_drift`) with the most replicas' answers of the round, ties going to the answers
that agree with the teacher's first answers (pinned at the first check). One faulty replica, even
the first checked, so never marks the good ones DEGRADED; a teacher with one replica is compared
with its own first answers. The check runs off the request path and at low priority: it waits for the replica
to have nothing outstanding (for at most one more interval, so a saturated replica is still checked)
and goes straight to its engine, past the batcher, so it is never counted as served traffic.

A replica whose drift (max |delta log-prob| over every canary row) exceeds `max_drift` is DEGRADED:
routing leaves it out while a HEALTHY replica exists (`ReplicaSet.pick`); a later check within
`max_drift` makes it HEALTHY again. A batch-invariant teacher's replicas on one device type drift
by exactly 0. Reported as `proctor:replica_drift` and `proctor:replica_drift_checks_total`, and
in ListTeachers (the replica's state, drift and checks; the teacher's max_drift).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from proctor.server.common.background import cancel_and_wait
from proctor.server.common.metrics import NULL_SINK, MetricsSink
from proctor.server.engines.base import EngineConfigError, EngineInfo, EngineRequest, RequestRejected
from proctor.server.engines.token_ids import token_array
from proctor.server.front.fleet.replicas import Replica, ReplicaState

log = logging.getLogger(__name__)

CANARY_SEED = 20_260_127  # the canaries' token ids: the same on every server of every version


@dataclass(frozen=True)
class DriftSettings:
    """A teacher's drift check (`inference.drift_check_interval_s`, `drift_canaries`,
    `drift_canary_tokens`, `max_drift`); `interval_s` None turns it off."""

    interval_s: float | None = 60.0
    canaries: int = 4
    canary_tokens: int = 64
    max_drift: float = 0.01

    @classmethod
    def from_inference(cls, inference: Mapping[str, Any] | None) -> DriftSettings:
        """The settings a teacher's `inference` block gives (defaults for keys it leaves out),
        checked: a bad value is an EngineConfigError naming its key. An interval of null or 0: off."""
        inference, default = inference or {}, cls()
        interval = inference.get("drift_check_interval_s", default.interval_s)
        return cls(
            interval_s=None if not interval else _setting("drift_check_interval_s", interval, float, 0),
            canaries=_setting("drift_canaries", inference.get("drift_canaries", default.canaries), int, 1),
            canary_tokens=_setting("drift_canary_tokens", inference.get("drift_canary_tokens", default.canary_tokens),
                                   int, 2),
            max_drift=_setting("max_drift", inference.get("max_drift", default.max_drift), float, 0),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.interval_s)


def _setting(key: str, value: Any, kind: type, low: float) -> Any:
    """`value` of `inference.<key>` as `kind`, at least `low`; else an EngineConfigError naming the key."""
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low
            or (kind is int and value != int(value))):
        what = "an integer" if kind is int else "a number"
        raise EngineConfigError(f"inference.{key} is {value!r}; it must be {what} >= {low:g}")
    return kind(value)


def canaries(settings: DriftSettings, info: EngineInfo) -> list[np.ndarray]:
    """The teacher's canaries: token ids from a fixed seed over its vocabulary, as long as it scores."""
    rng = np.random.default_rng(CANARY_SEED)
    length = max(2, min(settings.canary_tokens, info.max_sequence_tokens))
    return list(rng.integers(0, info.vocab_size, size=(settings.canaries, length), dtype=np.int64))


def canary_request(index: int, ids: np.ndarray) -> EngineRequest:
    """Canary `index` as an engine request (its log-probs only)."""
    return EngineRequest(request_id=f"proctor-canary-{index}", token_ids=token_array(ids), first_row=1,
                         logprobs=True, topk=0, hidden_states=False)


def _drift(answers: Mapping[int, torch.Tensor], reference: Mapping[int, torch.Tensor]) -> float:
    """max |delta log-prob| over the canaries both hold."""
    return max((_max_delta(answers[i], reference[i]) for i in answers if i in reference), default=0.0)


def _max_delta(answer: torch.Tensor, reference: torch.Tensor) -> float:
    if answer.shape != reference.shape:
        return math.inf
    delta = float((answer.double() - reference.double()).abs().max()) if answer.numel() else 0.0
    return math.inf if math.isnan(delta) else delta


class DriftCheck:
    """One teacher's drift check: its canaries, the teacher's first answers, each replica's drift."""

    def __init__(self, teacher: str, settings: DriftSettings) -> None:
        self.teacher = teacher
        self.settings = settings
        self.sink: MetricsSink = NULL_SINK
        self.drift: dict[str, float] = {}  # replica id -> its latest drift
        self.checks: dict[str, int] = {}  # replica id -> drift checks it ran
        self._canaries: dict[int, np.ndarray] | None = None  # index -> token ids (rejected ones dropped)
        self._first: dict[int, torch.Tensor] = {}  # index -> the teacher's first answer (log-probs): pinned
        self._task: asyncio.Task | None = None

    def forget_answers(self) -> None:
        """Drop the first answers and every replica's drift: the teacher serves another step now
        (`checkpoint_move`), whose first answers the next check pins."""
        self._first = {}
        self.drift.clear()
        self.checks.clear()

    def replica_fields(self, replica_id: str) -> dict[str, Any]:
        """The ReplicaInfo fields of a replica's drift (none before its first check)."""
        if replica_id not in self.checks:
            return {}
        return {"drift": self.drift[replica_id], "drift_checks": self.checks[replica_id]}

    async def answers(self, replica: Replica, info: EngineInfo) -> dict[int, torch.Tensor] | None:
        """The canaries' log-probs on `replica` now, or None when the check could not run (no
        engine, an engine error, the replica taken down meanwhile: health and failover are the
        supervisor's business)."""
        engine, generation = replica.engine, replica.generation
        if self._canaries is None:
            self._canaries = dict(enumerate(canaries(self.settings, info)))
        if engine is None or not self._canaries:
            return None
        batch = {index: canary_request(index, ids) for index, ids in self._canaries.items()}
        try:
            outcomes = await engine.score(list(batch.values()))
        except Exception as exc:
            log.warning("teacher %s: drift check of replica %s did not run: %s", self.teacher, replica.replica_id, exc)
            return None
        if replica.generation != generation or not replica.state.running:
            return None
        answers: dict[int, torch.Tensor] = {}
        for index, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, RequestRejected):  # ids this teacher refuses alone (a media placeholder)
                # Expected on a multimodal teacher (random ids hit its placeholder ids), so not a warning.
                log.info("teacher %s: canary %d left out of the drift check (the teacher refuses its random ids "
                         "alone: %s); the other canaries still check", self.teacher, index, outcome)
                del self._canaries[index]
                continue
            if isinstance(outcome, BaseException):
                log.warning("teacher %s: drift check of replica %s failed: %s", self.teacher, replica.replica_id, outcome)
                return None
            answers[index] = outcome.logprobs.clone()
            self._first.setdefault(index, answers[index])
        return answers

    def reference(self, round_answers: Mapping[str, dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """The answers of the replica that most of the round's replicas agree with (ties: the one
        agreeing with the pinned first answers, then the first listed); the first answers when
        fewer than two replicas answered."""
        if len(round_answers) < 2:
            return self._first
        limit = self.settings.max_drift
        names = list(round_answers)

        def standing(name: str) -> tuple[int, bool]:
            votes = sum(_drift(round_answers[other], round_answers[name]) <= limit for other in names)
            return votes, _drift(round_answers[name], self._first) <= limit

        return round_answers[max(names, key=standing)]

    def check_round(self, replicas: Mapping[str, Replica], round_answers: Mapping[str, dict[int, torch.Tensor]],
                    notify: Callable[[Replica], None]) -> dict[str, float]:
        """Each answering replica's drift from the round's reference, recorded and judged."""
        reference = self.reference(round_answers)
        drifts = {}
        for name, answers in round_answers.items():
            drifts[name] = _drift(answers, reference)
            self._record(replicas[name], drifts[name])
            self.judge(replicas[name], drifts[name], notify)
        return drifts

    def _record(self, replica: Replica, drift: float) -> None:
        self.drift[replica.replica_id] = drift
        self.checks[replica.replica_id] = self.checks.get(replica.replica_id, 0) + 1
        self.sink.replica_drift(self.teacher, replica.replica_id, drift)

    def judge(self, replica: Replica, drift: float, notify: Callable[[Replica], None]) -> None:
        """DEGRADED above max_drift, HEALTHY again within it."""
        limit = self.settings.max_drift
        if drift > limit and replica.state is ReplicaState.HEALTHY:
            log.warning("teacher %s replica %s is degraded: its canaries drift by %.3g (max_drift %.3g)",
                        self.teacher, replica.replica_id, drift, limit)
            replica.state = ReplicaState.DEGRADED
            notify(replica)
        elif drift <= limit and replica.state is ReplicaState.DEGRADED:
            log.info("teacher %s replica %s is healthy again: drift %.3g", self.teacher, replica.replica_id, drift)
            replica.state = ReplicaState.HEALTHY
            notify(replica)

    # -- the periodic check ------------------------------------------------------------------
    def start(self, replicas: Sequence[Replica], info: Callable[[], EngineInfo],
              notify: Callable[[Replica], None]) -> None:
        """Check every running replica every `interval_s` seconds, in the background."""
        if self._task is None and self.settings.enabled:
            self._task = asyncio.get_running_loop().create_task(
                self._run(replicas, info, notify), name=f"proctor-drift-{self.teacher}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self, replicas: Sequence[Replica], info: Callable[[], EngineInfo],
                   notify: Callable[[Replica], None]) -> None:
        interval = float(self.settings.interval_s or 0)
        while True:
            await asyncio.sleep(interval)
            round_answers: dict[str, dict[int, torch.Tensor]] = {}
            for replica in [r for r in replicas if r.state.running]:
                try:
                    await _idle(replica, interval)
                    answers = await self.answers(replica, info())
                    if answers is not None:
                        round_answers[replica.replica_id] = answers
                except Exception:  # the check must never die: it is what notices a drifting replica
                    log.exception("drift check of teacher %s replica %s failed", self.teacher, replica.replica_id)
            try:
                self.check_round({r.replica_id: r for r in replicas}, round_answers, notify)
            except Exception:
                log.exception("drift check of teacher %s failed", self.teacher)


async def _idle(replica: Replica, patience_s: float) -> None:
    """Wait until the replica has nothing outstanding (requests come first), for at most `patience_s`."""
    deadline = time.monotonic() + patience_s
    while replica.outstanding_tokens > 0 and time.monotonic() < deadline:
        await asyncio.sleep(min(0.5, patience_s / 20))
