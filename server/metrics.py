"""Prometheus metrics, named `proctor:*` in the style of vLLM's `vllm:*`.

One process owns every counter: the gRPC and HTTP servers run in the same event loop, so
the numbers are exact without prometheus' multiprocess mode. Each server gets its own
registry, so several servers in one process (tests) never share counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Scoring is a prefill: most requests finish well under a second, long multimodal ones in a few.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
                    1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("proctor:requests", "Scoring requests by outcome.",
                                ["teacher", "mode", "outcome"], registry=r)
        self.scored_tokens = Counter("proctor:scored_tokens",
                                     "Tokens replayed through a teacher (prompt + response).",
                                     ["teacher", "mode"], registry=r)
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
        self.replica_scored = Counter("proctor:replica_scored_requests", "Results delivered by each replica.",
                                      ["teacher", "replica"], registry=r)
        self.teacher_swaps = Counter("proctor:teacher_swaps", "Teacher weights swapped onto devices.",
                                     ["teacher"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
