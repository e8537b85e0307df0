"""Replica workers: each replica's engine in a process of its own, the front moving bytes.

Two real torch replicas behind one in-process server (the front), each in its own worker
process (`worker.main`). Faults are real: SIGKILL or SIGSTOP of a worker's process, found by
its pid. Answers are checked against the float64 reference while replicas fail under them, and
the answer bytes the front splices are checked against the messages built field by field.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import signal

import httpx
import numpy as np
import pytest
import torch

from proctor.proto import decode_tensor, encode_tensor, scoring_pb2
from proctor.server.common.errors import Code, ScoringError
from proctor.server.common.metrics import Metrics
from proctor.server.engines.base import EngineRequest, EngineResult
from proctor.server.front.fleet.routing import ReplicaState
from proctor.server.front.responses import Responses
from proctor.server.front.service import ScoredRequest
from proctor.server.front.validation import check_finite
from proctor.server.worker.client import WorkerClient
from proctor.server.worker.protocol import OUT_OF_BAND_BYTES, dumps, loads
from proctor.server.worker.wire import EncodedResult, RawRows, encode_result, nonfinite_outputs

from support.reference import assert_matches_reference, reference_rows
from support.scoring import grpc_score, logprobs_of, sequences
from support.servers import start_server, wait_for

HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 2.0


@pytest.fixture
def two_workers(tiny_model_dir):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=64,
                      inference={"health_timeout_s": HEALTH_TIMEOUT_S})
    router = single_teacher_router(spec, name="tiny", replicas=2, health_check_interval_s=HEALTH_INTERVAL_S)
    server = start_server(router)
    yield server
    server.stop()


def _replicas(server):
    return server.server.service.router.teachers["tiny"].replicas


def _worker_pids(server) -> list[int]:
    return [r.engine.pid for r in _replicas(server)]


def test_each_torch_replica_runs_in_a_worker_process_of_its_own(two_workers, tiny_model_dir):
    pids = _worker_pids(two_workers)
    assert all(isinstance(r.engine, WorkerClient) for r in _replicas(two_workers))
    assert len(set(pids)) == 2 and os.getpid() not in pids
    ids = sequences(1, seed=3)[0]
    answer = grpc_score(two_workers.grpc_target, ids, topk=5)
    assert_matches_reference(logprobs_of(answer), tiny_model_dir, ids, atol=1e-5)


def test_answers_through_workers_equal_the_reference_on_every_transport(two_workers, tiny_model_dir):
    ids = sequences(1, seed=11, length=(30, 31))[0]
    ref = reference_rows(tiny_model_dir, ids, first_row=4)
    request = scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=4, logprobs=True, topk=6, hidden_states=True)
    body = httpx.post(two_workers.http_url + "/v1/score", content=request.SerializeToString(),
                      headers={"content-type": "application/x-protobuf"}, timeout=60)
    assert body.status_code == 200
    answer = scoring_pb2.ScoreResponse.FromString(body.content)
    assert (answer.first_row, answer.num_tokens, answer.teacher) == (4, len(ids), "tiny")
    torch.testing.assert_close(decode_tensor(answer.logprobs).double(), ref.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(decode_tensor(answer.topk_logprobs).double(), ref.topk(6)[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(decode_tensor(answer.hidden_states), ref.hidden_states, rtol=0, atol=1e-5)
    assert answer.hidden_states.first_row == 4
    as_json = httpx.post(two_workers.http_url + "/v1/score", json={"token_ids": ids, "prompt_length": 4, "topk": 6},
                         timeout=60).json()
    assert as_json["logprobs"][:4] == [None] * 4
    torch.testing.assert_close(torch.tensor(as_json["logprobs"][4:]).double(), ref.logprobs, rtol=0, atol=1e-5)


def _stop_all(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def test_a_worker_killed_mid_request_is_failed_over_and_restarted(two_workers, tiny_model_dir):
    """Both workers are stopped with requests in them; one is SIGKILLed, the other resumed:
    every request is answered exactly, and the killed replica comes back in a new process."""
    replicas = _replicas(two_workers)
    victim, survivor = replicas
    old = _worker_pids(two_workers)
    seqs = sequences(24, seed=5)
    _stop_all(old)
    try:
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(grpc_score, two_workers.grpc_target, ids, request_id=str(i), timeout=120)
                       for i, ids in enumerate(seqs)]
            wait_for(lambda: all(r.batcher is not None and r.batcher.running_requests > 0 and r.outstanding_tokens
                                 for r in replicas), timeout=30)
            os.kill(old[0], signal.SIGKILL)
            os.kill(old[1], signal.SIGCONT)
            answers = [f.result(timeout=120) for f in futures]
    finally:
        for pid in old[1:]:
            os.kill(pid, signal.SIGCONT)
    for ids, answer in zip(seqs, answers, strict=True):
        assert_matches_reference(logprobs_of(answer), tiny_model_dir, ids, atol=1e-5)
    wait_for(lambda: victim.state is ReplicaState.HEALTHY and victim.engine is not None, timeout=60)
    assert victim.failures >= 1 and victim.engine.pid != old[0]
    assert survivor.engine.pid == old[1]
    assert victim.served + survivor.served >= len(seqs)


def test_a_hung_worker_is_detected_killed_and_restarted(two_workers, tiny_model_dir):
    """SIGSTOP: the worker stops answering its health probe; it is killed (its stopped process
    too), restarted in a new process, and requests sent meanwhile are answered by the other."""
    victim = _replicas(two_workers)[0]
    hung = victim.engine.pid
    os.kill(hung, signal.SIGSTOP)
    try:
        seqs = sequences(8, seed=9)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda ids: grpc_score(two_workers.grpc_target, ids, timeout=120), seqs))
        for ids, answer in zip(seqs, answers, strict=True):
            assert_matches_reference(logprobs_of(answer), tiny_model_dir, ids, atol=1e-5)
        wait_for(lambda: victim.failures >= 1, timeout=30)
        wait_for(lambda: victim.state is ReplicaState.HEALTHY and victim.engine is not None, timeout=60)
        assert victim.engine.pid != hung
        wait_for(lambda: not _alive(hung), timeout=15)  # the stopped process was killed, not left behind
    finally:
        if _alive(hung):
            os.kill(hung, signal.SIGKILL)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the wire form of results -----------------------------------------------------------------


def _result(hidden_dtype: torch.dtype = torch.bfloat16) -> EngineResult:
    g = torch.Generator().manual_seed(0)
    return EngineResult(
        first_row=3,
        logprobs=torch.randn(7, generator=g),
        topk_ids=torch.randint(0, 500, (7, 4), generator=g, dtype=torch.int32),
        topk_logprobs=torch.randn(7, 4, generator=g),
        hidden_states=torch.randn(7, 5, generator=g).to(hidden_dtype),
        ranks=torch.arange(1, 8),
        engine_seconds=0.25,
    )


def test_an_encoded_result_reads_back_the_same_tensors():
    result = _result()
    encoded = encode_result(result)
    assert isinstance(encoded, EncodedResult) and encode_result(encoded) is encoded
    for name in ("logprobs", "topk_ids", "topk_logprobs", "hidden_states", "ranks"):
        assert torch.equal(getattr(encoded, name), getattr(result, name)), name
    assert encoded.score_logprobs is None
    assert (encoded.first_row, encoded.engine_seconds) == (3, 0.25)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_score_is_read_where_the_result_is_encoded_and_refused_by_the_front(bad):
    """NaN or +inf in a log-prob output is found while the tensors are at hand (the replica
    worker), carried as names across the socket, and refused by the front without reading a row;
    -inf (score_ids padding, probability 0) is a log-prob and passes."""
    result = _result()
    result.topk_logprobs[2, 1] = bad
    result.score_logprobs = torch.full((7, 3), -math.inf)
    encoded = loads(dumps(("reply", 1, [encode_result(result)])))[2][0]
    assert encoded.nonfinite == nonfinite_outputs(result) == ("topk_logprobs",)
    request = EngineRequest("a", np.arange(10, dtype=np.int32), first_row=3, logprobs=True, topk=4,
                            hidden_states=False)
    for answer in (encoded, result):  # a replica worker's result, and an in-process engine's
        with pytest.raises(ScoringError) as error:
            check_finite(request, answer)
        assert error.value.code is Code.INTERNAL and "topk_logprobs" in error.value.message
    with pytest.raises(ScoringError) as error:  # the caller's temperature overflowed: the caller's error
        check_finite(dataclasses.replace(request, temperature=1e-38), encoded)
    assert error.value.code is Code.INVALID_ARGUMENT and error.value.field == "temperature"
    clean = encode_result(_result())
    assert clean.nonfinite == ()
    check_finite(request, clean)
    Responses(Metrics()).protobuf(_scored(clean))
    assert "_message" not in clean.__dict__  # the gRPC path checked and answered it without decoding a row


def _scored(result) -> ScoredRequest:
    return ScoredRequest("r-1", "tiny", "tiny-teacher", 10, result, "logprobs+topk")


def _expected(result: EngineResult) -> scoring_pb2.ScoreResponse:
    """The answer built field by field, as the server built it before splicing."""
    first = result.first_row
    return scoring_pb2.ScoreResponse(
        request_id="r-1", teacher="tiny", model="tiny-teacher", num_tokens=10, first_row=first,
        logprobs=encode_tensor(result.logprobs, first_row=first),
        topk_ids=encode_tensor(result.topk_ids, first_row=first),
        topk_logprobs=encode_tensor(result.topk_logprobs, first_row=first),
        hidden_states=encode_tensor(result.hidden_states, first_row=first),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_spliced_answer_bytes_are_the_message_built_field_by_field(dtype):
    result = _result(dtype)
    responses = Responses(Metrics())
    spliced = scoring_pb2.ScoreResponse.FromString(responses.protobuf(_scored(encode_result(result))))
    assert spliced == _expected(result)
    # In-process engines' results take the same path.
    assert scoring_pb2.ScoreResponse.FromString(responses.protobuf(_scored(result))) == _expected(result)


def test_streamed_chunks_reassemble_the_hidden_rows_in_order():
    result = _result(torch.float32)
    row_bytes = 5 * 4
    responses = Responses(Metrics(), chunk_bytes=2 * row_bytes)  # two rows a chunk: 4 chunks of hidden rows
    chunks = [scoring_pb2.ScoreChunk.FromString(c) for c in responses.chunks(_scored(encode_result(result)))]
    assert [c.last for c in chunks] == [False, False, False, False, True]
    head = chunks[0].response
    expected = _expected(result)
    assert (head.request_id, head.first_row, head.logprobs, head.topk_ids) == (
        "r-1", 3, expected.logprobs, expected.topk_ids)
    pieces = [c.response.hidden_states for c in chunks[1:]]
    assert [p.first_row for p in pieces] == [3, 5, 7, 9]
    assert all(c.response.request_id == "r-1" for c in chunks[1:])
    torch.testing.assert_close(torch.cat([decode_tensor(p) for p in pieces]), result.hidden_states, rtol=0, atol=0)


def test_a_requests_ids_cross_the_worker_socket_as_int32_arrays_out_of_band():
    """The ids' one form (`engines.base`) travels as it is: numpy int32, its bytes beside the
    pickle, received as a view of the frame, not a copy (engines read ids, never write them);
    other tensors as raw bytes."""
    ids, score_ids = np.arange(100, dtype=np.int32), np.full((99, 3), -1, dtype=np.int32)
    request = EngineRequest("a", ids, first_row=1, logprobs=True, topk=0, hidden_states=False, score_ids=score_ids)
    assert request.token_ids is ids and request.score_ids is score_ids  # the one form is kept, not copied
    payload = dumps(("score", 1, [request]))
    assert ids.tobytes() in payload and score_ids.tobytes() in payload  # raw int32, not a torch.save zip
    back = loads(payload)[2][0]
    for sent, got in ((ids, back.token_ids), (score_ids, back.score_ids)):
        assert type(got) is np.ndarray and got.dtype == np.int32 and np.array_equal(got, sent)
        assert not got.flags.owndata and got.flags.c_contiguous  # a view of the frame
    odd = torch.randn(4, 6).to(torch.bfloat16)[:, ::2]  # bf16, not contiguous
    assert torch.equal(loads(dumps(odd)), odd)
    assert len(dumps(torch.zeros(10_000, dtype=torch.int64))) < 10_000 * 8 + 200  # raw bytes, no torch.save zip


def test_large_result_bytes_cross_out_of_band_as_views_of_the_frame():
    encoded = encode_result(_result(torch.float32))
    big = RawRows.of(torch.randn(OUT_OF_BAND_BYTES // 4, 2))
    message = ("reply", 3, [EncodedResult(encoded.outputs, big, encoded.raw_ranks, first_row=3)])
    back = loads(dumps(message))[2][0]
    assert isinstance(back.hidden.data, memoryview)  # not copied out of the frame
    assert torch.equal(back.hidden_states, big.tensor()) and torch.equal(back.logprobs, encoded.logprobs)
    assert back.first_row == 3


def test_vllm_replicas_on_cpu_bind_their_own_cores(monkeypatch):
    """Two vLLM replicas on CPU (devices 0 and 1 in the plan) start with different core binds
    (vLLM's "auto" put both on core 0: a restarting replica starved the serving one); replica i
    gets core i mod the cores this process may run on; the operator's own bind is left alone, and
    the torch engine gets none."""
    from dataclasses import replace

    from proctor.server.engines.base import EngineSpec
    from proctor.server.worker.client import engine_environment

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    spec = EngineSpec(name="vllm", model_path="m", device="cpu")
    binds = [engine_environment(replace(spec, devices=(str(i),))).get("VLLM_CPU_OMP_THREADS_BIND") for i in range(3)]
    assert binds == [str(cores[i % len(cores)]) for i in range(3)]
    if len(cores) > 1:
        assert binds[0] != binds[1]
    assert engine_environment(replace(spec, devices=("0", "1")))["VLLM_CPU_OMP_THREADS_BIND"] == (
        f"{cores[0]}|{cores[1 % len(cores)]}")  # one list per tensor-parallel rank
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_environment(replace(spec, name="torch", devices=("1",)))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_environment(replace(spec, devices=("1",)))


def test_replicas_from_the_flags_get_their_own_cpu_devices(tiny_model_dir):
    """`proctor serve --replicas 2 --device cpu` (no config): replica i's device is i, so a vLLM
    replica binds core i (before, every replica of the flags had no device and vLLM bound core 0)."""
    from proctor.server.config.builder import _flag_replica_spec
    from proctor.server.engines.base import EngineSpec
    from proctor.server.worker.client import engine_environment

    spec = EngineSpec(name="vllm", model_path=str(tiny_model_dir), device="cpu")
    binds = {engine_environment(_flag_replica_spec(spec, i)).get("VLLM_CPU_OMP_THREADS_BIND") for i in range(2)}
    assert len(binds) == min(2, len(os.sched_getaffinity(0))) and None not in binds
