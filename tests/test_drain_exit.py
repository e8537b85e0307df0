"""SIGTERM under a stock gRPC client that keeps calling: every call is answered or refused with
UNAVAILABLE (the status the README promises while draining, and the one stock clients retry),
never CANCELLED. gRPC core's own server shutdown fails the calls it has received but not handed
to a handler, and those that reach a connection before the client reads the GOAWAY, with
CANCELLED (one to three a drain in this test before `serve_until_terminated` ended the process
under a still-answering gRPC server)."""

from __future__ import annotations

import collections
import signal
import threading
import time

import grpc

from proctor.proto import scoring_pb2, scoring_pb2_grpc

from support.drain import start_drain_server

CALLERS = 24


def test_a_drain_under_steady_calls_answers_unavailable_never_cancelled(tiny_model_dir):
    proc, target, _ = start_drain_server(tiny_model_dir, delay=0.05, grace=20)
    codes: collections.Counter = collections.Counter()
    stop = threading.Event()
    request = scoring_pb2.ScoreRequest(token_ids=[1, 2, 3, 4], logprobs=True)

    def caller() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = scoring_pb2_grpc.TeacherScoringStub(channel)
            while not stop.is_set():
                try:
                    stub.Score(request, timeout=10)
                    codes["OK"] += 1
                except grpc.RpcError as error:
                    codes[error.code().name] += 1
                    time.sleep(0.002)  # a stock client's quick retry: it keeps the port busy to the end

    callers = [threading.Thread(target=caller, daemon=True) for _ in range(CALLERS)]
    try:
        for thread in callers:
            thread.start()
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(1)  # calls made after the process ended: a closed port, also UNAVAILABLE
    finally:
        stop.set()
        for thread in callers:
            thread.join(timeout=30)
        if proc.poll() is None:
            proc.kill()
    assert codes["OK"] > 0 and codes["UNAVAILABLE"] > 0, codes
    assert set(codes) == {"OK", "UNAVAILABLE"}, codes
