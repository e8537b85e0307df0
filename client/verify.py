"""`proctor verify`: do a running server's replicas agree? The smoke test of a deployment.

For each teacher the server lists, every running replica scores the same sequences, each request
pinned to that replica (`ScoreRequest.replica`, no failover): alone, one at a time, and inside
mixed batches, sent together with filler requests of other lengths to the same replica, so that its
batcher scores them in one batch. Every answer's log-probs are compared with the first replica's
answers alone, and a table shows max |delta log-prob| per replica and batch size.

A replica above the threshold fails the check, by name, and so does a replica that is not running.
The threshold defaults to 0 for a batch-invariant teacher (its scores must agree bit for bit), else
to the teacher's `max_drift`, else to `DEFAULT_THRESHOLD`.

The sequences are built in (token ids from a fixed seed over the teacher's vocabulary, of mixed
lengths) or read from a file: a JSON list of token-id lists, or one such list per line.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from proctor.client.client import TeacherClient, TeacherInfo
from proctor.client.retry import RetryPolicy
from proctor.proto import scoring_pb2

BATCH_SIZES = (1, 8, 32)
DEFAULT_THRESHOLD = 0.01
SEED = 2026
_RUNNING = (scoring_pb2.HEALTHY, scoring_pb2.DEGRADED)


@dataclass
class TeacherReport:
    """One teacher's verdict: max |delta log-prob| per replica and batch size against `reference`."""

    teacher: TeacherInfo
    reference: str  # the replica whose lone answers every other answer is compared with
    threshold: float
    deltas: dict[str, dict[int, float]] = field(default_factory=dict)
    not_running: dict[str, str] = field(default_factory=dict)  # replica id -> its state's name

    def failures(self) -> list[str]:
        """One line per replica that fails the check, naming it."""
        lines = [f"teacher {self.teacher.name!r} replica {r!r} is {state}, not serving: it was not checked"
                 for r, state in self.not_running.items()]
        for replica, by_size in self.deltas.items():
            worst = max(by_size.values())
            if worst > self.threshold:
                where = ", ".join(f"batch {size}: {_number(value)}" for size, value in by_size.items())
                lines.append(f"teacher {self.teacher.name!r} replica {replica!r} disagrees with replica "
                             f"{self.reference!r}: max |delta log-prob| {_number(worst)} > threshold "
                             f"{_number(self.threshold)} ({where})")
        return lines

    def table(self, batch_sizes: tuple[int, ...] = BATCH_SIZES) -> str:
        kind = "batch-invariant" if self.teacher.batch_invariant else "not batch-invariant"
        lines = [f"teacher {self.teacher.name} ({self.teacher.engine}, {kind}): max |delta log-prob| against "
                 f"replica {self.reference} alone; threshold {_number(self.threshold)}",
                 f"{'replica':<20}" + "".join(f"{'batch ' + str(size):>14}" for size in batch_sizes)]
        for replica, by_size in self.deltas.items():
            lines.append(f"{replica:<20}" + "".join(f"{_number(by_size[size]):>14}" for size in batch_sizes))
        lines.extend(f"{replica:<20}{state:>14}" for replica, state in self.not_running.items())
        return "\n".join(lines)


def _number(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


def builtin_sequences(vocab_size: int, max_tokens: int, *, count: int = 16, seed: int = SEED) -> list[list[int]]:
    """`count` sequences of mixed lengths (8 up to 96 tokens, within `max_tokens`) from a fixed seed."""
    rng = np.random.default_rng(seed)
    longest = max(2, min(96, max_tokens))
    lengths = rng.integers(min(8, longest), longest + 1, size=count)
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]


def read_sequences(path: str | Path) -> list[list[int]]:
    """Token-id sequences from a file: a JSON list of lists, or one JSON list per line."""
    text = Path(path).read_text()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(value, list) or not value or not all(
            isinstance(seq, list) and len(seq) >= 2 and all(isinstance(t, int) for t in seq) for seq in value):
        raise ValueError(f"{path}: expected token-id sequences (lists of at least 2 integers), as a JSON list "
                         "of lists or one list per line")
    return value


def default_threshold(teacher: TeacherInfo) -> float:
    """0 for a batch-invariant teacher, else its max_drift, else DEFAULT_THRESHOLD."""
    if teacher.batch_invariant:
        return 0.0
    return teacher.max_drift if teacher.max_drift is not None else DEFAULT_THRESHOLD


def _max_delta(answers: list, reference: list) -> float:
    worst = 0.0
    for got, want in zip(answers, reference, strict=True):
        delta = float((got.logprobs.double() - want.logprobs.double()).abs().max())
        worst = max(worst, math.inf if math.isnan(delta) else delta)
    return worst


class _Scorer:
    """Pinned scoring of one teacher's sequences: alone, or batched with fillers."""

    def __init__(self, client: TeacherClient, teacher: TeacherInfo, sequences: list[list[int]]) -> None:
        self.client = client
        self.key = teacher.keys[0] if teacher.keys else teacher.name
        self.sequences = sequences
        rng = np.random.default_rng(SEED + 1)
        longest = max(len(s) for s in sequences)
        self.fillers = [rng.integers(0, teacher.vocab_size, size=int(n)).tolist()
                        for n in rng.integers(2, longest + 1, size=max(BATCH_SIZES))]

    async def _one(self, ids: list[int], replica: str):
        return await self.client.score(ids, teacher_key=self.key, replica=replica)

    async def alone(self, replica: str) -> list:
        return [await self._one(ids, replica) for ids in self.sequences]

    async def batched(self, replica: str, size: int) -> list:
        """Each sequence in a burst of `size` requests to `replica`: half (at least one) of the
        sequences, the rest fillers, all sent at once, so that they share the replica's batches."""
        group = max(1, size // 2)
        answers = []
        for start in range(0, len(self.sequences), group):
            mine = self.sequences[start:start + group]
            burst = mine + self.fillers[: size - len(mine)]
            scored = await asyncio.gather(*(self._one(ids, replica) for ids in burst))
            answers.extend(scored[: len(mine)])
        return answers


async def verify_teacher(client: TeacherClient, teacher: TeacherInfo, sequences: list[list[int]] | None, *,
                         threshold: float | None = None, batch_sizes: tuple[int, ...] = BATCH_SIZES) -> TeacherReport:
    """Score `sequences` (None: the built-in ones) on every running replica of `teacher`."""
    states = dict(teacher.replicas)
    running = [r for r, state in states.items() if state in _RUNNING]
    report = TeacherReport(teacher, running[0] if running else "",
                           default_threshold(teacher) if threshold is None else threshold,
                           not_running={r: scoring_pb2.ReplicaState.Name(s) for r, s in states.items()
                                        if s not in _RUNNING})
    if not running:
        return report
    scorer = _Scorer(client, teacher, sequences or builtin_sequences(teacher.vocab_size, teacher.max_model_len))
    reference = await scorer.alone(report.reference)
    for replica in running:
        by_size = {}
        for size in batch_sizes:
            answers = await (scorer.alone(replica) if size == 1 else scorer.batched(replica, size))
            by_size[size] = _max_delta(answers, reference)
        report.deltas[replica] = by_size
    return report


async def verify(target: str, *, threshold: float | None = None, sequences: list[list[int]] | None = None,
                 token: str | None = None, timeout: float = 120.0) -> list[TeacherReport]:
    """Every teacher of the server at `target`, each replica checked (`verify_teacher`)."""
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.2)
    async with TeacherClient(target, token=token, max_concurrency=max(BATCH_SIZES), timeout=timeout,
                             retry=retry) as client:
        teachers = await client.teachers()
        return [await verify_teacher(client, teacher, sequences, threshold=threshold)
                for teacher in teachers.values()]
