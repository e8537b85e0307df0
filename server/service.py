"""The transport-neutral scoring service: validate, admit, route, score, account.

gRPC and HTTP are thin shells over this class: both hand it a `ScoreRequest` message and
turn its `ScoringError`s into their own status codes. Admission is a bounded per-teacher
budget of requests and tokens: past it a request is refused at once with a retry hint
(never an unbounded wait), so an overloaded teacher pushes back on its trainers instead of
piling up memory.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from proctor.proto import scoring_pb2, wire_dtype
from proctor.server.bounded_json import loads_bounded
from proctor.server.engines.base import EngineRequest, EngineResult, MediaItem, MultiModalInputs
from proctor.server.errors import Code, ScoringError, invalid
from proctor.server.media import MediaLimits, decode_media
from proctor.server.metrics import Metrics
from proctor.server.routing import Replica, ReplicaState, Router, Teacher

log = logging.getLogger(__name__)


class ServiceState(str, enum.Enum):
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


@dataclass
class Scored:
    """One answered request, ready for a transport to encode."""

    request_id: str
    teacher: str
    model: str
    num_tokens: int
    result: EngineResult
    mode: str


@dataclass
class _Admission:
    requests: int = 0
    tokens: int = 0


def request_mode(request: scoring_pb2.ScoreRequest) -> str:
    """A metrics label naming what was asked for, e.g. "logprobs+topk"."""
    parts = [name for name, on in (("logprobs", request.logprobs), ("topk", request.topk > 0),
                                   ("hidden_states", request.hidden_states)) if on]
    return "+".join(parts) or "none"


def _media(items, field: str) -> tuple[MediaItem, ...]:
    out = []
    for index, item in enumerate(items):
        if not item.data:
            raise invalid(f"{field}[{index}].data", "is empty")
        if not item.media_type:
            raise invalid(f"{field}[{index}].media_type", "is required (e.g. image/png)")
        out.append(MediaItem(bytes(item.data), item.media_type))
    return tuple(out)


class ScoringService:
    def __init__(self, router: Router, *, limits: Limits | None = None, metrics: Metrics | None = None) -> None:
        self.router = router
        self.limits = limits or Limits()
        self.metrics = metrics or Metrics()
        self.state = ServiceState.LOADING
        self._admitted: dict[str, _Admission] = {name: _Admission() for name in router.teachers}
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._counted: dict[tuple[str, str], tuple[int, int, int]] = {}
        router.attach_metrics(self.metrics)
        for teacher in router.teachers.values():
            teacher._on_replica_state = self._replica_changed
            self._watch_queue(teacher)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(t.start() for t in self.router.teachers.values()))
        self.state = ServiceState.SERVING

    async def stop(self) -> None:
        self.state = ServiceState.STOPPED
        await self.router.stop()

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting, then wait up to grace_s for admitted requests; True when all finished."""
        self.state = ServiceState.DRAINING
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_s)
            return True
        except asyncio.TimeoutError:
            return False

    def ready(self) -> bool:
        return self.state is ServiceState.SERVING and all(t.healthy() for t in self.router.teachers.values())

    # -- metrics plumbing ------------------------------------------------------------------
    def _replica_changed(self, teacher: Teacher, replica: Replica) -> None:
        healthy = 1.0 if replica.state is ReplicaState.HEALTHY else 0.0
        labels = (teacher.name, replica.replica_id)
        self.metrics.replica_healthy.labels(*labels).set(healthy)
        self._count_replica(labels, replica)

    def _count_replica(self, labels: tuple[str, str], replica: Replica) -> None:
        """Advance the failure/restart/scored counters to the replica's own counts."""
        failures, restarts, served = self._counted.get(labels, (0, 0, 0))
        self.metrics.replica_failures.labels(*labels).inc(replica.failures - failures)
        self.metrics.replica_restarts.labels(*labels).inc(replica.restarts - restarts)
        self.metrics.replica_scored.labels(*labels).inc(replica.served - served)
        self._counted[labels] = (replica.failures, replica.restarts, replica.served)

    def _watch_queue(self, teacher: Teacher) -> None:
        def waiting() -> float:
            return float(sum(r.batcher.waiting for r in teacher.replicas if r.batcher))

        def running() -> float:
            return float(sum(r.batcher.running_requests for r in teacher.replicas if r.batcher))

        self.metrics.waiting.labels(teacher.name).set_function(waiting)
        self.metrics.running.labels(teacher.name).set_function(running)

    # -- validation ------------------------------------------------------------------------
    def validate(self, request: scoring_pb2.ScoreRequest, teacher: Teacher) -> EngineRequest:
        info = teacher.info
        count = len(request.token_ids)
        if count > info.max_sequence_tokens:  # checked before any copy of a huge list
            spare = "" if info.max_sequence_tokens == info.max_model_len else (
                "; the engine keeps one of its max_model_len slots for the output token of the prefill")
            raise invalid(
                "token_ids",
                f"has {count} tokens, more than teacher {teacher.name!r} scores ({info.max_sequence_tokens}: "
                f"max_model_len {info.max_model_len}{spare})",
            )
        ids = list(request.token_ids)
        if not ids:
            raise invalid("token_ids", "is empty; send the prompt and response token ids")
        if len(ids) < 2:
            raise invalid("token_ids", "needs at least 2 tokens (row 0 has no prefix to score)")
        # numpy, not torch: torch calls on the event loop can stall behind the engine's thread.
        array = np.asarray(ids, dtype=np.int64)
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= info.vocab_size:
            bad = low if low < 0 else high
            position = ids.index(bad)
            raise invalid("token_ids", f"token {bad} at position {position} is outside [0, {info.vocab_size})")
        first_row = 1
        if request.HasField("prompt_length"):
            first_row = request.prompt_length
            if not 1 <= first_row < len(ids):
                raise invalid(
                    "prompt_length", f"is {first_row}; it must be in [1, {len(ids) - 1}] for {len(ids)} tokens"
                )
        if request.topk < 0:
            raise invalid("topk", f"is {request.topk}; it must be >= 0")
        if request.topk > info.max_topk:
            raise invalid("topk", f"is {request.topk}; teacher {teacher.name!r} serves at most {info.max_topk}")
        if request.topk > info.vocab_size:
            raise invalid("topk", f"is {request.topk}; the vocabulary has {info.vocab_size} tokens")
        if not (request.logprobs or request.topk or request.hidden_states):
            raise invalid("logprobs", "nothing asked for: set logprobs, topk > 0 or hidden_states")
        if request.hidden_states and "hidden_states" not in info.outputs:
            raise invalid("hidden_states", f"teacher {teacher.name!r} does not serve hidden states")
        media = MultiModalInputs(
            images=_media(request.images, "images"),
            videos=_media(request.videos, "videos"),
            audios=_media(request.audios, "audios"),
            processor_kwargs=self._processor_kwargs(request.mm_processor_kwargs),
        )
        for kind in media.kinds():
            if kind not in info.media:
                raise invalid(
                    kind,
                    f"teacher {teacher.name!r} ({info.engine} engine) is text-only and cannot use {kind}"
                    if not info.media
                    else f"teacher {teacher.name!r} accepts {', '.join(info.media)}, not {kind}",
                )
        return EngineRequest(
            request_id=request.request_id,
            token_ids=torch.from_numpy(array),
            first_row=first_row,
            logprobs=request.logprobs,
            topk=request.topk,
            hidden_states=request.hidden_states,
            media=media if media else None,
        )

    async def _decoded(self, request: EngineRequest) -> EngineRequest:
        """The request with its media decoded and checked, off the event loop, before admission:
        a bad item is this request's INVALID_ARGUMENT and never reaches a replica."""
        from dataclasses import replace

        try:
            media = await asyncio.to_thread(decode_media, request.media, self.limits.media)
        except ValueError as exc:
            field = str(exc).split(":", 1)[0].split("[", 1)[0] or "images"
            raise ScoringError(Code.INVALID_ARGUMENT, str(exc), field=field) from None
        return replace(request, media=media)

    @staticmethod
    def _processor_kwargs(text: str) -> dict:
        if not text:
            return {}
        value = loads_bounded(text, field="mm_processor_kwargs")
        if not isinstance(value, dict):
            raise invalid("mm_processor_kwargs", "must be a JSON object")
        return value

    # -- scoring ---------------------------------------------------------------------------
    def _admit(self, teacher: Teacher, tokens: int) -> _Admission:
        admission = self._admitted[teacher.name]
        if (
            admission.requests + 1 > self.limits.max_queue_requests
            or admission.tokens + tokens > self.limits.max_queue_tokens
        ):
            raise ScoringError(
                Code.RESOURCE_EXHAUSTED,
                f"teacher {teacher.name!r} queue is full ({admission.requests} requests, "
                f"{admission.tokens} tokens admitted); retry later",
                retry_after=self._retry_after(teacher),
            )
        admission.requests += 1
        admission.tokens += tokens
        self._in_flight += 1
        self._idle.clear()
        return admission

    def _release(self, admission: _Admission, tokens: int) -> None:
        admission.requests -= 1
        admission.tokens -= tokens
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def _retry_after(self, teacher: Teacher) -> float:
        """A hint from the recent engine time: about one batch's worth of waiting."""
        replicas = max(1, len(teacher.healthy()))
        waiting = self._admitted[teacher.name].requests
        return round(min(30.0, 0.05 + 0.01 * waiting / replicas), 3)

    async def score(self, request: scoring_pb2.ScoreRequest, *, timeout: float | None = None) -> Scored:
        """Score one request end to end; raises ScoringError with the contract's codes."""
        started = time.monotonic()
        mode = request_mode(request)
        teacher_name = "unknown"
        try:
            if self.state is not ServiceState.SERVING:
                raise ScoringError(Code.UNAVAILABLE, f"server is {self.state.value}", retry_after=5.0)
            teacher = self.router.route(request.teacher_key)
            teacher_name = teacher.name
            engine_request = self.validate(request, teacher)
            if not engine_request.request_id:
                engine_request = _with_id(engine_request, uuid.uuid4().hex)
            if engine_request.media:
                engine_request = await self._decoded(engine_request)
            admission = self._admit(teacher, engine_request.num_tokens)
            try:
                result = await self._score_admitted(teacher, engine_request, timeout)
            finally:
                self._release(admission, engine_request.num_tokens)
        except ScoringError as exc:
            self.metrics.requests.labels(teacher_name, mode, exc.code.name.lower()).inc()
            raise
        except asyncio.CancelledError:
            self.metrics.requests.labels(teacher_name, mode, "cancelled").inc()
            raise
        except Exception as exc:
            log.exception("scoring failed")
            self.metrics.requests.labels(teacher_name, mode, "internal").inc()
            raise ScoringError(Code.INTERNAL, f"scoring failed: {exc}") from exc
        self.metrics.requests.labels(teacher.name, mode, "ok").inc()
        for replica in teacher.replicas:
            self._count_replica((teacher.name, replica.replica_id), replica)
        self.metrics.scored_tokens.labels(teacher.name, mode).inc(engine_request.num_tokens)
        self.metrics.request_latency.labels(teacher.name).observe(time.monotonic() - started)
        self.metrics.queue_time.labels(teacher.name).observe(result.queue_seconds)
        self.metrics.engine_time.labels(teacher.name).observe(result.engine_seconds)
        return Scored(
            request_id=engine_request.request_id,
            teacher=teacher.name,
            model=teacher.info.model,
            num_tokens=engine_request.num_tokens,
            result=result,
            mode=mode,
        )

    async def _score_admitted(
        self, teacher: Teacher, request: EngineRequest, timeout: float | None
    ) -> EngineResult:
        limit = timeout if timeout is not None else self.limits.default_timeout_s
        if limit is None:
            return await teacher.score(request)
        if limit <= 0:
            raise ScoringError(Code.DEADLINE_EXCEEDED, "deadline already passed before scoring started")
        try:
            return await asyncio.wait_for(teacher.score(request), timeout=limit)
        except asyncio.TimeoutError as exc:
            raise ScoringError(Code.DEADLINE_EXCEEDED, f"not scored within the deadline ({limit:.3f}s)") from exc

    def record_bytes(self, scored: Scored, size: int) -> None:
        self.metrics.response_bytes.labels(scored.teacher, scored.mode).inc(size)

    # -- catalogue -------------------------------------------------------------------------
    def teacher_infos(self) -> list[scoring_pb2.TeacherInfo]:
        infos = []
        for teacher in self.router.teachers.values():
            replicas = [
                scoring_pb2.ReplicaInfo(replica_id=r.replica_id, state=int(r.state), devices=list(r.devices), node=r.node)
                for r in teacher.replicas
            ]
            try:
                info = teacher.info
            except ScoringError:
                infos.append(scoring_pb2.TeacherInfo(name=teacher.name, keys=list(teacher.keys), replicas=replicas))
                continue
            infos.append(
                scoring_pb2.TeacherInfo(
                    name=teacher.name,
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
                    keys=list(teacher.keys),
                    media=list(info.media),
                )
            )
        return infos

    def unembedding(self, teacher_key: str) -> tuple[torch.Tensor, str]:
        """The teacher's lm_head [V, H] and its fingerprint."""
        if self.state is not ServiceState.SERVING:
            raise ScoringError(Code.UNAVAILABLE, f"server is {self.state.value}", retry_after=5.0)
        teacher = self.router.route(teacher_key)
        replica = next((r for r in teacher.healthy() if r.engine is not None), None)
        if replica is None:
            raise ScoringError(Code.UNAVAILABLE, f"teacher {teacher.name!r} has no healthy replica", retry_after=5.0)
        return replica.engine.unembedding(), teacher.info.fingerprint


def _with_id(request: EngineRequest, request_id: str) -> EngineRequest:
    from dataclasses import replace

    return replace(request, request_id=request_id)

