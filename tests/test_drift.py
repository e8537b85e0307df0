"""The drift check on a real three-replica torch teacher whose third replica's weights are perturbed.

Replicas dr-0 and dr-1 load the tiny teacher; dr-2 loads a copy of it with 1e-3 noise on every
weight (`support.perturbed`), each in a replica worker of its own. The teacher is batch-invariant
and checks its replicas every CHECK_S seconds on 4 canaries: dr-2 is marked DEGRADED by its first or
second check, routing stops sending it traffic, `proctor:replica_drift` shows its drift while dr-0
(the teacher's first answer) and dr-1 stay at exactly 0, and `proctor verify` exits 1 naming it.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proctor.server.engines.base import EngineSpec
from proctor.server.front.fleet.drift import DriftSettings
from proctor.server.front.fleet.routing import Replica, ReplicaSet, ReplicaState

from support.perturbed import perturbed_copy
from support.routers import replica_router
from support.scoring import grpc_score, sequences
from support.servers import start_server, wait_for

CHECK_S = 2.0
MAX_DRIFT = 1e-4
INFERENCE = {"batch_invariant": True}


def _drift_server(name: str, paths: list):
    """A batch-invariant teacher `name` whose replica i loads `paths[i]`, checked every CHECK_S."""
    specs = [EngineSpec("torch", str(path), inference=INFERENCE) for path in paths]
    settings = DriftSettings(interval_s=CHECK_S, canaries=4, canary_tokens=32, max_drift=MAX_DRIFT)
    return start_server(replica_router(name, specs, drift=settings, health_check_interval_s=None))


@pytest.fixture(scope="module")
def drifting(tiny_model_dir, tmp_path_factory):
    perturbed = perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("perturbed"), scale=1e-3)
    server = _drift_server("dr", [tiny_model_dir, tiny_model_dir, perturbed])
    yield server
    server.stop()


def _replicas(server) -> dict[str, dict]:
    (teacher,) = httpx.get(f"{server.http_url}/v1/teachers").json()["teachers"]
    return {r["replica_id"]: r for r in teacher["replicas"]}


@pytest.fixture(scope="module")
def first_degraded(drifting) -> dict[str, dict]:
    """ListTeachers' replicas when dr-2 is first seen DEGRADED (one snapshot, taken on the server's loop)."""
    seen: list[dict] = []

    def degraded() -> bool:
        seen.append(_replicas(drifting))
        return seen[-1]["dr-2"]["state"] == "DEGRADED"

    wait_for(degraded, timeout=120, interval=0.1)
    return seen[-1]


def _metrics(server) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.http_url}/metrics").text):
        for sample in family.samples:
            if "replica" in sample.labels:
                out[(sample.name, sample.labels["replica"])] = sample.value
    return out


def test_the_perturbed_replica_is_degraded_by_its_first_or_second_check(first_degraded):
    assert 1 <= int(first_degraded["dr-2"]["drift_checks"]) <= 2
    assert first_degraded["dr-2"]["drift"] > MAX_DRIFT


def test_the_unperturbed_replicas_stay_healthy_at_zero_drift(drifting, first_degraded):
    wait_for(lambda: all(int(r.get("drift_checks", 0)) >= 1 for r in _replicas(drifting).values()), timeout=60)
    replicas = _replicas(drifting)
    for name in ("dr-0", "dr-1"):
        assert replicas[name]["state"] == "HEALTHY" and replicas[name]["drift"] == 0.0


def test_the_metric_shows_the_drift(drifting, first_degraded):
    wait_for(lambda: _metrics(drifting).get(("proctor:replica_drift_checks_total", "dr-1"), 0) >= 1, timeout=60)
    metrics = _metrics(drifting)
    assert metrics[("proctor:replica_drift", "dr-2")] > MAX_DRIFT
    assert metrics[("proctor:replica_drift", "dr-0")] == 0.0 and metrics[("proctor:replica_drift", "dr-1")] == 0.0
    assert all(metrics[("proctor:replica_drift_checks_total", r)] >= 1 for r in ("dr-0", "dr-1", "dr-2"))
    assert metrics[("proctor:replica_healthy", "dr-2")] == 0.0 and metrics[("proctor:replica_healthy", "dr-0")] == 1.0


def test_its_traffic_moves_to_the_other_replicas(drifting, first_degraded):
    teacher = drifting.server.service.router.teachers["dr"]
    before = {r.replica_id: r.served for r in teacher.replicas}
    for ids in sequences(12, seed=4):
        grpc_score(drifting.grpc_target, ids)
    moved = {r.replica_id: r.served - before[r.replica_id] for r in teacher.replicas}
    assert moved["dr-2"] == 0 and moved["dr-0"] + moved["dr-1"] == 12


def test_list_teachers_and_health_show_the_degraded_replica(drifting, first_degraded):
    (teacher,) = httpx.get(f"{drifting.http_url}/v1/teachers").json()["teachers"]
    assert teacher["max_drift"] == MAX_DRIFT and teacher["batch_invariant"] is True
    ready = httpx.get(f"{drifting.http_url}/health/ready")
    assert ready.status_code == 200 and ready.json()["degraded"] == ["dr/dr-2"]


def test_proctor_verify_exits_1_naming_the_perturbed_replica(drifting, first_degraded):
    done = subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "verify", "--target",
                           f"grpc://{drifting.grpc_target}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]]
            for line in done.stdout.splitlines() if line.startswith("dr-")}
    assert rows["dr-0"] == rows["dr-1"] == [0.0, 0.0, 0.0]
    assert min(rows["dr-2"]) > MAX_DRIFT  # pinned, the degraded replica still answers
    (failure,) = [line for line in done.stderr.splitlines() if line.startswith("proctor verify:")]
    assert "replica 'dr-2' disagrees with replica 'dr-0'" in failure


def test_a_degraded_replica_takes_requests_only_when_no_healthy_one_is_left():
    healthy, degraded = Replica("h", None, state=ReplicaState.HEALTHY), Replica("d", None, state=ReplicaState.DEGRADED)
    teacher = ReplicaSet("t", [degraded, healthy])
    assert teacher.pick(set()) is healthy and teacher.in_service() == [healthy]
    assert teacher.pick({"h"}) is degraded  # the healthy one was tried: the degraded one is next
    healthy.state = ReplicaState.UNHEALTHY
    assert teacher.pick(set()) is degraded and teacher.in_service() == [degraded]
    assert teacher.pick(set(), pinned="h") is None and teacher.pick(set(), pinned="d") is degraded


@pytest.fixture(scope="module")
def faulty_first(tiny_model_dir, tmp_path_factory):
    """The same teacher with the perturbed replica first (fd-0): the one the check used to take
    as every canary's reference."""
    perturbed = perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("perturbed-first"), scale=1e-3)
    server = _drift_server("fd", [perturbed, tiny_model_dir, tiny_model_dir])
    yield server
    server.stop()


def test_a_faulty_first_replica_is_outvoted_and_never_degrades_the_good_ones(faulty_first):
    """The majority of each round is the reference: fd-0 is DEGRADED at its first round, fd-1 and
    fd-2 stay HEALTHY at drift 0 in every round seen."""
    seen: list[dict] = []

    def judged_twice() -> bool:
        seen.append(_replicas(faulty_first))
        return all(int(r.get("drift_checks", 0)) >= 2 for r in seen[-1].values())

    wait_for(judged_twice, timeout=120, interval=0.1)
    for snapshot in seen:
        for name in ("fd-1", "fd-2"):
            assert snapshot[name]["state"] == "HEALTHY", snapshot
            assert snapshot[name].get("drift", 0.0) == 0.0, snapshot
    first_judged = next(s for s in seen if int(s["fd-0"].get("drift_checks", 0)) >= 1)
    assert first_judged["fd-0"]["state"] == "DEGRADED" and first_judged["fd-0"]["drift"] > MAX_DRIFT
