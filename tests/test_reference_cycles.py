"""Refused calls leave nothing behind for the cyclic collector: a refused body is freed the moment
its answer is sent, not whenever `gc` next runs.

A task whose result is read (`task.result()`, `await gather(...)`) in a frame that holds the task
makes a cycle when the result is an exception: the exception's traceback holds the frame, the frame
the task, the task the exception. Everything those frames hold (the body's bytes, the decoded
request: ~24 MB for an 8 MB body) then waits for the collector, and the allocator's raised trim
threshold (`common/malloc_tuning.py`) keeps what it frees. These tests run with the collector off
and count the refusals' exceptions still alive: each one found is a cycle.
"""

from __future__ import annotations

import gc
import json

import httpx
import pytest

from proctor.server.common.errors import ScoringError


def _live_scoring_errors() -> int:
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), ScoringError))


@pytest.fixture
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/score", {"teacher_key": "nobody", "token_ids": list(range(1, 200))}),  # refused at routing
    ("/v1/completions", {"model": "nobody", "prompt": list(range(1, 200))}),  # refused at routing
    ("/v1/completions", {"model": "tiny", "prompt": [[1, 2, 3], [1, 100000]], "max_tokens": 1, "prompt_logprobs": 0}),  # refused in score_all's gather
])
def test_refused_http_bodies_leave_no_cycle(torch_server, collector_off, path, body):
    before = _live_scoring_errors()
    with httpx.Client(base_url=torch_server.http_url, timeout=30) as client:
        for _ in range(5):
            answer = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert 400 <= answer.status_code < 500, answer.text
    assert _live_scoring_errors() - before == 0
