"""The transport-neutral scoring service: validate, admit, route, score, account.

gRPC and HTTP are thin shells over this class: both hand it a `ScoreRequest` message and
turn its `ScoringError`s into their own status codes; `responses` builds their answers. The
request path touches each piece once: transport → `route` (once) → `validation.validate` →
media decoded off the loop → admission → `ReplicaSet.score` (replica, batcher, engine) →
`ScoredRequest` → `responses` (encoding and byte count) → transport. Admission is a bounded per-teacher
budget of requests and tokens: past it a request is refused at once with a retry hint
(never an unbounded wait), so an overloaded teacher pushes back on its trainers instead of
piling up memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from proctor.proto import scoring_pb2, wire_dtype
from proctor.server.common.errors import NOT_READY_RETRY_S, Code, ScoringError, invalid
from proctor.server.common.metrics import Metrics
from proctor.server.engines.base import EngineResult
from proctor.server.engines.fingerprint import tokenizer_fingerprint
from proctor.server.engines.hidden_forms import projected_unembedding
from proctor.server.engines.media import MediaLimits
from proctor.server.engines.teacher_serves import most_body_numbers
from proctor.server.front.aligned_scoring import AlignedScoring
from proctor.server.front.fleet.routing import ReplicaSet, Router
from proctor.server.front.validation import ValidRequest, check_finite, decode, request_mode, validate

log = logging.getLogger(__name__)


class ServiceState(str, enum.Enum):  # noqa: UP042 (str() of a member is its name here, as before)
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Limits:
    """Admission limits per teacher (requests and tokens admitted, running or waiting)."""

    max_queue_requests: int = 1024
    max_queue_tokens: int = 8_000_000
    default_timeout_s: float | None = None
    media: MediaLimits = field(default_factory=MediaLimits)
    # A unary answer's hidden states must fit one message: half the transports' message limit.
    max_answer_bytes: int = 32 << 20


@dataclass
class ScoredRequest:
    """One answered request, ready for `responses` to encode."""

    request_id: str
    teacher: str
    model: str
    num_tokens: int
    result: EngineResult
    mode: str
    # An aligned request's answer in the student's rows (`alignment.answer.AlignedAnswer`); then
    # `num_tokens` is the student's and `result` the teacher's rows over its own sequence.
    aligned: Any = None

    @property
    def first_row(self) -> int:
        """The first row answered: the student's for an aligned request."""
        return self.aligned.first_row if self.aligned is not None else self.result.first_row


@dataclass
class _Admission:
    requests: int = 0
    tokens: int = 0


class ScoringService:
    """Validation (once, for both transports), admission, scoring and the catalogue."""

    def __init__(self, router: Router, *, limits: Limits | None = None, metrics: Metrics | None = None,
                 student_tokenizers: Mapping[str, str] | None = None) -> None:
        self.router = router
        self.aligned = AlignedScoring(student_tokenizers)
        self.limits = limits or Limits()
        self.metrics = metrics or Metrics()
        self.state = ServiceState.LOADING
        self._admitted: dict[str, _Admission] = {name: _Admission() for name in router.teachers}
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        # Each teacher's tokenizer digest, read at start (`ListTeachers.tokenizer_fingerprint`).
        self._tokenizer_fingerprints: dict[str, str] = {}
        router.use_metrics(self.metrics)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.aligned.load(self.router.teachers.values())  # before the replicas: a bad one stops the start
        self._tokenizer_fingerprints = await asyncio.to_thread(self._read_tokenizer_fingerprints)
        await asyncio.gather(*(t.start() for t in self.router.teachers.values()))
        self.state = ServiceState.SERVING

    def _read_tokenizer_fingerprints(self) -> dict[str, str]:
        return {name: tokenizer_fingerprint(t.tokenizer_path) if t.tokenizer_path and Path(t.tokenizer_path).is_dir()
                else "" for name, t in self.router.teachers.items()}

    async def stop(self) -> None:
        self.state = ServiceState.STOPPED
        await self.router.stop()

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting, then wait up to grace_s for admitted requests; True when all finished."""
        self.state = ServiceState.DRAINING
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_s)
            return True
        except TimeoutError:
            return False

    def ready(self) -> bool:
        return self.state is ServiceState.SERVING and all(t.in_service() for t in self.router.teachers.values())

    def check_serving(self) -> None:
        if self.state is not ServiceState.SERVING:
            raise ScoringError(Code.UNAVAILABLE, f"server is {self.state.value}", retry_after=NOT_READY_RETRY_S)

    # -- scoring ---------------------------------------------------------------------------
    def route(self, request: scoring_pb2.ScoreRequest) -> ReplicaSet:
        """The teacher `request` goes to, once per request: `score` routes with it, and a transport
        that must know the teacher before scoring (/v1/completions tokenizes text with the
        teacher's tokenizer) routes here and scores with `score_on`. A server not serving, or a key
        that names no teacher, is counted under the teacher "unknown"."""
        try:
            self.check_serving()
            return self.router.route(request.teacher_key)
        except ScoringError as exc:
            self.metrics.request_done("unknown", request_mode(request), exc.code.name.lower())
            raise

    @contextlib.contextmanager
    def _counted(self, teacher: str, mode: str) -> Iterator[None]:
        """Count a request that fails in the block under its teacher and mode; an unexpected
        fault becomes INTERNAL (with its traceback in the log), never a bare exception."""
        try:
            yield
        except ScoringError as exc:
            self.metrics.request_done(teacher, mode, exc.code.name.lower())
            raise
        except asyncio.CancelledError:
            self.metrics.request_done(teacher, mode, "cancelled")
            raise
        except Exception as exc:
            log.exception("scoring failed")
            self.metrics.request_done(teacher, mode, "internal")
            raise ScoringError(Code.INTERNAL, f"scoring failed: {exc}") from exc

    def admit(self, teacher_set: ReplicaSet, tokens: int) -> _Admission:
        """Count `tokens` against the teacher's budget, or refuse at once (RESOURCE_EXHAUSTED)."""
        admission = self._admitted[teacher_set.name]
        if (
            admission.requests + 1 > self.limits.max_queue_requests
            or admission.tokens + tokens > self.limits.max_queue_tokens
        ):
            raise ScoringError(
                Code.RESOURCE_EXHAUSTED,
                f"teacher {teacher_set.name!r} queue is full ({admission.requests} requests, "
                f"{admission.tokens} tokens admitted); retry later",
                retry_after=teacher_set.retry_hint(admission.tokens),
            )
        admission.requests += 1
        admission.tokens += tokens
        self._in_flight += 1
        self._idle.clear()
        return admission

    def release(self, admission: _Admission, tokens: int) -> None:
        admission.requests -= 1
        admission.tokens -= tokens
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def score(
        self, request: scoring_pb2.ScoreRequest, *, timeout: float | None = None, unary: bool = True
    ) -> ScoredRequest:
        """Score one request end to end; raises ScoringError with the contract's codes.

        `unary`: the answer goes in one message, so hidden states must fit `limits.max_answer_bytes`
        (streamed answers have no such bound). A request naming a `student_tokenizer` is aligned:
        scored as the teacher's request, answered in the student's rows."""
        teacher_set = self.route(request)
        if request.student_tokenizer:
            return await self._score_aligned(teacher_set, request, timeout=timeout, unary=unary)
        return await self.score_on(teacher_set, request, timeout=timeout, unary=unary)

    async def _score_aligned(self, teacher_set: ReplicaSet, request: scoring_pb2.ScoreRequest, *,
                             timeout: float | None, unary: bool) -> ScoredRequest:
        """An aligned request: sizes counted, admitted at the teacher's length, planned, scored by
        the teacher's path (counted there) and mapped to the student's rows (`AlignedScoring`)."""
        mode = request_mode(request)
        with self._counted(teacher_set.name, mode):
            ask = self.aligned.check(request, teacher_set)
            admission = self.admit(teacher_set, ask.tokens)
        try:
            with self._counted(teacher_set.name, mode):
                plan = await self.aligned.plan(ask)
            scored = await self.score_on(teacher_set, plan.teacher_request, timeout=timeout, unary=unary,
                                         mode=mode, admitted=True)
        finally:
            self.release(admission, ask.tokens)
        answer = await self.aligned.answer(ask, plan, scored.result)
        return replace(scored, num_tokens=plan.num_tokens, aligned=answer)

    async def score_on(self, teacher_set: ReplicaSet, request: scoring_pb2.ScoreRequest, *,
                       timeout: float | None = None, unary: bool = True, mode: str | None = None,
                       admitted: bool = False, ranks: bool = False) -> ScoredRequest:
        """Score a request over the teacher's own ids on `teacher_set` (routed by `route`), counted
        under `mode` (default its own); `admitted`: its caller has admitted it already (an aligned
        request, admitted before planning); `ranks`: the actual tokens' ranks too (vLLM-shaped
        answers carry them, gRPC's do not)."""
        started = time.monotonic()
        mode = mode or request_mode(request)
        with self._counted(teacher_set.name, mode):
            self.check_serving()
            valid = validate(teacher_set, request, max_answer_bytes=self.limits.max_answer_bytes if unary else None,
                             ranks=ranks)
            valid = await decode(valid, self.limits.media)
            tokens = valid.request.num_tokens
            admission = None if admitted else self.admit(teacher_set, tokens)
            try:
                result = await self._score_admitted(valid, timeout)
                check_finite(valid.request, result)
            finally:
                if admission is not None:
                    self.release(admission, tokens)
        self.metrics.request_scored(teacher_set.name, mode, tokens, latency=time.monotonic() - started,
                                    queue=result.queue_seconds, engine=result.engine_seconds)
        return ScoredRequest(valid.request.request_id, teacher_set.name, teacher_set.info.model, tokens, result, mode)

    async def _score_admitted(self, valid: ValidRequest, timeout: float | None) -> EngineResult:
        limit = timeout if timeout is not None else self.limits.default_timeout_s
        if limit is None:
            return await valid.teacher_set.score(valid.request, replica_id=valid.replica)
        if limit <= 0:
            raise ScoringError(Code.DEADLINE_EXCEEDED, "deadline already passed before scoring started")
        try:  # a timeout scope, not wait_for: no task of its own per request
            async with asyncio.timeout(limit):
                return await valid.teacher_set.score(valid.request, replica_id=valid.replica)
        except TimeoutError as exc:
            raise ScoringError(Code.DEADLINE_EXCEEDED, f"not scored within the deadline ({limit:.3f}s)") from exc

    # -- catalogue -------------------------------------------------------------------------
    def most_body_numbers(self, *, sequences: int = 1, score_ids: bool = True) -> int | None:
        """The most numbers a JSON body may hold before it is parsed (`teacher_serves.most_body_numbers`
        for the teacher that accepts the most: the key is not known before the parse). None while a
        teacher is still loading (no bound known yet; the rules after the parse still hold)."""
        try:
            infos = [teacher_set.info for teacher_set in self.router.teachers.values()]
        except ScoringError:
            return None
        return max((most_body_numbers(info, sequences=sequences, score_ids=score_ids) for info in infos), default=None)

    def teacher_infos(self) -> list[scoring_pb2.TeacherInfo]:
        infos = []
        for teacher_set in self.router.teachers.values():
            drift = teacher_set.drift
            replicas = [
                scoring_pb2.ReplicaInfo(replica_id=r.replica_id, state=int(r.state), devices=list(r.devices), node=r.node,
                                        fingerprint=r.fingerprint, **(drift.replica_fields(r.replica_id) if drift is not None else {}))
                for r in teacher_set.replicas
            ]
            try:
                info = teacher_set.info
            except ScoringError:
                infos.append(scoring_pb2.TeacherInfo(name=teacher_set.name, keys=list(teacher_set.keys), replicas=replicas))
                continue
            infos.append(
                scoring_pb2.TeacherInfo(
                    name=teacher_set.name,
                    model=info.model,
                    fingerprint=info.fingerprint,
                    vocab_size=info.vocab_size,
                    hidden_size=info.hidden_size,
                    max_model_len=info.max_model_len,
                    max_topk=info.max_topk,
                    outputs=list(info.outputs),
                    replicas=replicas,
                    engine=info.engine,
                    dtype=wire_dtype(info.dtype),
                    keys=list(teacher_set.keys),
                    media=list(info.media),
                    score_ids_method=info.score_ids_method,
                    aligned_vocabularies=self.aligned.vocabularies(teacher_set.name),
                    chat_template=self.aligned.chat_template(teacher_set.name),
                    tokenizer_fingerprint=self._tokenizer_fingerprints.get(teacher_set.name, ""),
                    batch_invariant=info.batch_invariant,
                    max_drift=drift.settings.max_drift if drift is not None else None,
                    hidden_forms=list(info.hidden_forms), projection_rank=info.projection_rank,
                    projection_energy=info.projection_energy,
                )
            )
        return infos

    async def unembedding(self, teacher_key: str, projected: bool = False) -> tuple[torch.Tensor, str]:
        """The teacher's output embedding [V, H] (`projected`: W·P [V, r]) and its fingerprint, off the loop."""
        self.check_serving()
        teacher_set = self.router.route(teacher_key)
        if projected and not teacher_set.info.projection_rank:
            raise invalid("projected", f"teacher {teacher_set.name!r} has no hidden-state projection "
                          "(inference.hidden_projection_rank)")
        replica = next((r for r in teacher_set.in_service() if r.engine is not None), None)
        if replica is None:
            raise ScoringError(Code.UNAVAILABLE, f"teacher {teacher_set.name!r} has no healthy replica",
                               retry_after=teacher_set.retry_hint())
        fingerprint = replica.fingerprint or teacher_set.info.fingerprint  # its step's, during a move too
        weight = await replica.engine.fetch_unembedding()
        if projected:  # P from the same weights by the engines' own rule (`engines.hidden_forms`)
            weight = await asyncio.to_thread(projected_unembedding, weight, teacher_set.info.projection_rank,
                                             fingerprint)
        return weight, fingerprint


