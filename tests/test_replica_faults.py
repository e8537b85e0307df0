"""When request faults say a replica is unwell: the strike rule and the probe after a fault.

Real torch engines in this process; the sick replica is the real engine whose forward raises
the way a broken device does (every batch, whatever the request). Its twin answers the same
requests, so each fault there is evidence against the replica, not the request.
"""

from __future__ import annotations

import asyncio

import torch

from proctor.server.common.metrics import Metrics
from proctor.server.engines.base import EngineRequest, EngineSpec
from proctor.server.engines.torch.engine import TorchEngine
from proctor.server.front.fleet.replica_faults import StrikeRecord
from proctor.server.front.fleet.routing import ReplicaSet, ReplicaState, engine_replica

from support.reference import reference_rows
from support.scoring import sequences


class BrokenDevice(TorchEngine):
    """Every forward raises as a device that hit an illegal memory access does; `probe_ok` says
    whether its health probe notices (a sticky CUDA error does; a flaky one may not)."""

    probe_ok = True

    def _score_sync(self, batch, prepared=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def check_health(self) -> bool:
        return self.probe_ok and await super().check_health()


def _request(ids: list[int], index: int) -> EngineRequest:
    return EngineRequest(f"r{index}", torch.tensor(ids), 1, True, 0, False)


def _teacher(model_dir, *, probe_ok: bool) -> tuple[ReplicaSet, Metrics]:
    spec = EngineSpec(name="torch", model_path=str(model_dir))

    def sick() -> TorchEngine:
        engine = BrokenDevice(spec)
        engine.probe_ok = probe_ok
        return engine

    replicas = [engine_replica("sick", sick), engine_replica("well", lambda: TorchEngine(spec))]
    teacher = ReplicaSet("t", replicas, health_check_interval_s=None, policy="round_robin")
    metrics = Metrics()
    teacher.use_metrics(metrics)
    return teacher, metrics


def _count(metrics: Metrics, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.render().decode().splitlines()
               if line.startswith(name + "{"))


def test_strikes_count_distinct_requests_within_the_window():
    record = StrikeRecord(needed=2, window_s=10.0)
    assert not record.add("a", now=0.0)
    assert not record.add("a", now=1.0)  # the same request again is one strike
    assert not record.add("b", now=20.0)  # a's strike has expired
    assert record.add("c", now=21.0)


async def test_a_replica_failing_requests_another_answers_leaves_the_rotation(tiny_model_dir):
    teacher, metrics = _teacher(tiny_model_dir, probe_ok=True)
    await teacher.start()
    try:
        sick = teacher.replicas[0]
        ids = sequences(4, vocab=500, seed=4)
        for index, seq in enumerate(ids[:2]):  # round robin: each starts on the sick replica in turn
            teacher._rr = len(teacher.replicas) - 1  # the next pick is replica 0
            result = await teacher.score(_request(seq, index))
            assert result is not None
        assert sick.state is not ReplicaState.HEALTHY  # two different requests, answered elsewhere
        assert _count(metrics, "proctor:replica_failures_total") == 1
        assert _count(metrics, "proctor:poison_requests_total") == 0
        assert _count(metrics, "proctor:request_faults_total") == 2
    finally:
        await teacher.stop()


async def test_a_failed_probe_after_a_request_fault_takes_the_replica_out(tiny_model_dir):
    teacher, metrics = _teacher(tiny_model_dir, probe_ok=False)
    await teacher.start()
    try:
        sick = teacher.replicas[0]
        (seq,) = sequences(1, vocab=500, seed=5)
        teacher._rr = len(teacher.replicas) - 1
        request = _request(seq, 0)
        answered = await teacher.score(request)
        assert answered.logprobs is not None
        torch.testing.assert_close(answered.logprobs.double(), reference_rows(tiny_model_dir, seq).logprobs,
                                   atol=1e-4, rtol=0)
        for _ in range(200):  # the probe runs in the background (and the restart right after)
            if _count(metrics, "proctor:replica_failures_total"):
                break
            await asyncio.sleep(0.05)
        assert _count(metrics, "proctor:replica_failures_total") == 1
        assert sick.failures == 1
    finally:
        await teacher.stop()
