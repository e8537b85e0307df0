"""Prometheus metrics, named `proctor:*` in the style of vLLM's `vllm:*`.

This module owns every Prometheus object. Components never touch them: they are handed a
`MetricsSink` and report events to it (a replica's state changed, a batch started, a teacher
was swapped in), as vLLM's engine reports to its stat loggers; `Metrics` is the sink that
turns events into counters and gauges, `NULL_SINK` the one that ignores them.

One process owns every counter: the gRPC and HTTP servers run in the same event loop, so
the numbers are exact without prometheus' multiprocess mode. Each server gets its own
registry, so several servers in one process (tests) never share counts.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Scoring is a prefill: most requests finish well under a second, long multimodal ones in a few.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
                    1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


class MetricsSink:
    """What components report; every method does nothing here (the null sink)."""

    def replica_state(self, teacher: str, replica: str, healthy: bool) -> None:
        """A replica entered or left the rotation."""

    def replica_failed(self, teacher: str, replica: str) -> None:
        """A replica was taken out of rotation after a replica error."""

    def replica_restarted(self, teacher: str, replica: str) -> None:
        """A failed replica is back."""

    def replica_scored(self, teacher: str, replica: str) -> None:
        """A replica delivered one request's result."""

    def queue_changed(self, teacher: str, *, waiting: int = 0, running: int = 0) -> None:
        """Requests started (+) or stopped (-) waiting for a batch, or running in one."""

    def teacher_swapped(self, teacher: str) -> None:
        """A shared replica group copied this teacher's weights onto its devices."""

    def prompt_reused(self, teacher: str, tokens: int) -> None:
        """A request that prompt reuse applied to was scored: `tokens` of its prompt were not
        recomputed (0: a miss, its prompt was computed)."""

    def engine_computed(self, teacher: str, tokens: int) -> None:
        """The engine ran `tokens` positions through the model for one request (its own count)."""

    def request_fault(self, teacher: str, replica: str) -> None:
        """A request failed on this replica alone (a server fault of that request, `RequestFailed`)."""

    def poison_request(self, teacher: str) -> None:
        """A request failed on two replicas and was failed without a third try."""

    def replica_drift(self, teacher: str, replica: str, drift: float) -> None:
        """A drift check ran on this replica: max |delta log-prob| of its canaries (`front/drift.py`)."""


NULL_SINK = MetricsSink()

# The protocol the request in hand came through (`grpc`, `proctor_http`, `openai_completions`,
# `vllm_generate`, `sglang_generate`): set once per call by its transport (the gRPC servicer,
# the HTTP app's `TeacherPaths`), read when the request is counted, so the service and its
# shells pass nothing for it. A call made in-process, with no transport, is `direct`.
SURFACE: ContextVar[str] = ContextVar("proctor_surface", default="direct")


class Metrics(MetricsSink):
    """The Prometheus registry of one server, fed by the events of its components."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = Counter("proctor:requests", "Scoring requests by outcome and the surface they came through.",
                                ["teacher", "mode", "outcome", "surface"], registry=r)
        self.scored_tokens = Counter("proctor:scored_tokens",
                                     "Tokens replayed through a teacher (prompt + response).",
                                     ["teacher", "mode", "surface"], registry=r)
        self.response_bytes = Counter("proctor:response_bytes", "Bytes of scoring responses sent.",
                                      ["teacher", "mode"], registry=r)
        self.request_latency = Histogram("proctor:request_latency_seconds",
                                         "Time from admission to answer.", ["teacher"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("proctor:queue_time_seconds", "Time waiting for a batch.",
                                    ["teacher"], buckets=_LATENCY_BUCKETS, registry=r)
        self.engine_time = Histogram("proctor:engine_time_seconds", "Engine time of the request's batch.",
                                     ["teacher"], buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("proctor:requests_running", "Requests admitted and being scored.",
                             ["teacher"], registry=r)
        self.waiting = Gauge("proctor:requests_waiting", "Requests admitted and waiting for a batch.",
                             ["teacher"], registry=r)
        self.replica_healthy = Gauge("proctor:replica_healthy", "1 when the replica is in rotation.",
                                     ["teacher", "replica"], registry=r)
        self.replica_failures = Counter("proctor:replica_failures", "Times a replica was taken out of rotation.",
                                        ["teacher", "replica"], registry=r)
        self.replica_restarts = Counter("proctor:replica_restarts", "Times a failed replica was restarted.",
                                        ["teacher", "replica"], registry=r)
        self.replica_results = Counter("proctor:replica_scored_requests", "Results delivered by each replica.",
                                      ["teacher", "replica"], registry=r)
        self.request_faults = Counter("proctor:request_faults",
                                      "Requests that failed on a replica alone (a server fault of that request).",
                                      ["teacher", "replica"], registry=r)
        self.poison_requests = Counter("proctor:poison_requests",
                                       "Requests that failed on two replicas and were not tried on a third.",
                                       ["teacher"], registry=r)
        self.teacher_swaps = Counter("proctor:teacher_swaps", "Teacher weights swapped onto devices.",
                                     ["teacher"], registry=r)
        self.prompt_reuse_tokens = Counter("proctor:prompt_reuse_tokens",
                                           "Prompt tokens not recomputed: shared with an earlier request.",
                                           ["teacher"], registry=r)
        self.prompt_reuse_hits = Counter("proctor:prompt_reuse_hits",
                                         "Requests whose prompt was found computed (shared prompts).",
                                         ["teacher"], registry=r)
        self.prompt_reuse_misses = Counter("proctor:prompt_reuse_misses",
                                           "Requests prompt reuse applied to whose prompt was computed.",
                                           ["teacher"], registry=r)
        self.engine_computed_tokens = Counter(
            "proctor:engine_computed_tokens",
            "Token positions the engines ran through the model (their own count; reuse lowers it).",
            ["teacher"], registry=r)
        self.replica_drift_gauge = Gauge("proctor:replica_drift",
                                         "Max |delta log-prob| of the replica's canaries against the teacher's first "
                                         "answer, at its latest drift check.", ["teacher", "replica"], registry=r)
        self.replica_drift_checks = Counter("proctor:replica_drift_checks", "Drift checks each replica ran.",
                                            ["teacher", "replica"], registry=r)

    def _series(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once: prometheus_client's own lookup (label
        checks, a lock) costs microseconds, and the front reports several series per request."""
        key = (id(metric), labels)  # the metrics live as long as this object
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = metric.labels(*labels)
        return series

    # -- the sink --------------------------------------------------------------------------
    def replica_state(self, teacher: str, replica: str, healthy: bool) -> None:
        self._series(self.replica_healthy, teacher, replica).set(1.0 if healthy else 0.0)
        for counter in (self.replica_failures, self.replica_restarts, self.replica_results, self.request_faults):
            self._series(counter, teacher, replica)  # every replica's series exists from its first state
        self._series(self.poison_requests, teacher)

    def replica_failed(self, teacher: str, replica: str) -> None:
        self._series(self.replica_failures, teacher, replica).inc()

    def replica_restarted(self, teacher: str, replica: str) -> None:
        self._series(self.replica_restarts, teacher, replica).inc()

    def replica_scored(self, teacher: str, replica: str) -> None:
        self._series(self.replica_results, teacher, replica).inc()

    def queue_changed(self, teacher: str, *, waiting: int = 0, running: int = 0) -> None:
        if waiting:
            self._series(self.waiting, teacher).inc(waiting)
        if running:
            self._series(self.running, teacher).inc(running)

    def teacher_swapped(self, teacher: str) -> None:
        self._series(self.teacher_swaps, teacher).inc()

    def request_fault(self, teacher: str, replica: str) -> None:
        self._series(self.request_faults, teacher, replica).inc()

    def poison_request(self, teacher: str) -> None:
        self._series(self.poison_requests, teacher).inc()

    def replica_drift(self, teacher: str, replica: str, drift: float) -> None:
        self._series(self.replica_drift_gauge, teacher, replica).set(drift)
        self._series(self.replica_drift_checks, teacher, replica).inc()

    def prompt_reused(self, teacher: str, tokens: int) -> None:
        self._series(self.prompt_reuse_hits if tokens > 0 else self.prompt_reuse_misses, teacher).inc()
        self._series(self.prompt_reuse_tokens, teacher).inc(tokens)

    def engine_computed(self, teacher: str, tokens: int) -> None:
        self._series(self.engine_computed_tokens, teacher).inc(tokens)

    # -- the service's own counts ----------------------------------------------------------
    def request_done(self, teacher: str, mode: str, outcome: str) -> None:
        self._series(self.requests, teacher, mode, outcome, SURFACE.get()).inc()

    def request_scored(self, teacher: str, mode: str, tokens: int, *, latency: float, queue: float,
                       engine: float) -> None:
        surface = SURFACE.get()
        self._series(self.requests, teacher, mode, "ok", surface).inc()
        self._series(self.scored_tokens, teacher, mode, surface).inc(tokens)
        self._series(self.request_latency, teacher).observe(latency)
        self._series(self.queue_time, teacher).observe(queue)
        self._series(self.engine_time, teacher).observe(engine)

    def response_sent(self, teacher: str, mode: str, size: int) -> None:
        self._series(self.response_bytes, teacher, mode).inc(size)

    def render(self) -> bytes:
        return generate_latest(self.registry)
