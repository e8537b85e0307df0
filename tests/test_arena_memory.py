"""A replica worker's shared memory falls back after a burst (issue 23: bounded memory).

The real server (front in this process, the torch teacher in a replica worker process) scores
a burst of 256 hidden-state requests at once through the service, holds every answer (each
holds its hidden states as a view of the worker's shared arena), then drops them. The worker's
`RssShmem` (/proc/<pid>/status: the shared-memory pages mapped into it, i.e. the arena pages
it wrote) must have grown by well over 64 MiB during the burst and, once idle, be back within
64 MiB of its figure before it. The teacher is a tiny model with hidden size 256 (1 KiB of
hidden states per token) so that 256 answers of ~640 tokens make ~160 MiB.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time

import pytest
import torch

from proctor.proto import scoring_pb2

from support.reference import reference_rows
from support.scoring import sequences
from support.servers import engine_of, start_server

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd on this system")

MiB = 1 << 20
BURST = 256
LENGTH = (640, 641)
SLACK = 64 * MiB  # the bound: after the burst, within 64 MiB of before


def _rss_shmem(pid: int) -> int:
    """RssShmem of process `pid` in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no RssShmem in /proc status")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("wide-teacher"), hidden_size=256, num_layers=1)


@pytest.fixture(scope="module")
def worker_server(wide_model_dir):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec

    spec = EngineSpec(name="torch", model_path=str(wide_model_dir), inference={"max_model_len": 1024})
    server = start_server(single_teacher_router(spec, name="wide", replicas=1))
    yield server
    server.stop()


def test_a_burst_of_hidden_state_answers_leaves_the_workers_shared_memory_where_it_was(
    worker_server, wide_model_dir
):
    engine = engine_of(worker_server, "wide")
    pid = engine.pid
    assert pid is not None and pid != os.getpid() and engine._channel.protocol.arena is not None
    service = worker_server.server.service

    async def burst(seqs: list[list[int]]) -> list:
        requests = [scoring_pb2.ScoreRequest(token_ids=ids, hidden_states=True) for ids in seqs]
        return await asyncio.gather(*(service.score(r, unary=False) for r in requests))

    seqs = sequences(BURST, seed=23, length=LENGTH)
    before = _rss_shmem(pid)
    answers = worker_server.call(burst(seqs), timeout=120)  # all 256 held at once
    peak = _rss_shmem(pid)
    ref = reference_rows(wide_model_dir, seqs[-1])
    torch.testing.assert_close(answers[-1].result.hidden_states, ref.hidden_states, rtol=0, atol=1e-5)
    del answers
    gc.collect()  # the views go; the front reports their blocks free to the worker

    deadline = time.monotonic() + 10
    after = _rss_shmem(pid)
    while after > before + SLACK and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _rss_shmem(pid)
    print(f"worker RssShmem: before {before / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB, after {after / MiB:.1f} MiB")
    assert peak - before > 2 * SLACK, "the burst did not grow the arena enough for the test to mean anything"
    assert after <= before + SLACK

    # Space given back is used again: a second burst reaches past the warm part into released
    # pages (fresh zero pages once written), and every answer reads back right.
    seqs = sequences(80, seed=24, length=LENGTH)  # ~50 MiB held at once
    answers = worker_server.call(burst(seqs), timeout=120)
    assert _rss_shmem(pid) - after > 8 * MiB
    for ids, answer in zip(seqs, answers, strict=True):
        torch.testing.assert_close(answer.result.hidden_states, reference_rows(wide_model_dir, ids).hidden_states,
                                   rtol=0, atol=1e-5)
