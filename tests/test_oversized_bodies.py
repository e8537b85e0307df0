"""A JSON body is never parsed past what the teachers could accept: its numbers are counted on the
raw bytes first, and a body of millions of ids for a teacher of a few thousand tokens is refused
before `json.loads` sees it (issue 43: 50 MB of ids took 4 s of CPU to parse, then a 422)."""

from __future__ import annotations

import time

import httpx
import pytest

from proctor.server.common.errors import ScoringError
from proctor.server.front.bounded_json import loads_bounded


def test_numbers_are_counted_outside_strings_only():
    body = b'{"a": [1, -2, 3.5e-3, 40], "s": "1, 2, 3, [4] \\" 5, 6", "b": {"c": 7}}'
    assert loads_bounded(body, max_numbers=5)["b"] == {"c": 7}
    with pytest.raises(ScoringError, match="holds more than 4 numbers"):
        loads_bounded(body, max_numbers=4)


def test_the_count_stops_at_the_bound_and_runs_before_the_parse():
    body = b"[" + b"123456," * 3_000_000 + b"1]"  # 21 MB; invalid UTF-8 or JSON later would not matter
    started = time.perf_counter()
    with pytest.raises(ScoringError, match="holds more than 1000 numbers"):
        loads_bounded(body + b"\xff", max_numbers=1000)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize(("path", "field"), [("/v1/score", "token_ids"), ("/v1/completions", "prompt")])
def test_a_body_of_millions_of_ids_is_refused_before_it_is_parsed(torch_server, path, field):
    service = torch_server.server.service
    # Past the bound by one: for /v1/score 2M ids (12 MB) against a teacher of a few thousand tokens;
    # a completions call may carry as many prompts as the queue admits, so its bound is higher.
    most = service.most_body_numbers() if path == "/v1/score" else service.most_body_numbers(
        sequences=service.limits.max_queue_requests, score_ids=False)
    ids = ",".join(["12345"] * max(2_000_000, most + 1))
    extra = '"max_tokens": 1, "prompt_logprobs": 0,' if path == "/v1/completions" else '"logprobs": true,'
    body = f'{{{extra} "{field}": [{ids}]}}'.encode()
    started = time.perf_counter()
    answer = httpx.post(torch_server.http_url + path, content=body, timeout=120,
                        headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - started
    assert answer.status_code in (400, 422), answer.text
    assert "holds more than" in answer.text and "numbers" in answer.text, answer.text
    assert elapsed < 5.0  # the upload and the scan of the first megabyte; parsing it took seconds


@pytest.mark.parametrize(("path", "field"), [("/generate", "input_ids"), ("/inference/v1/generate", "token_ids"),
                                             ("/detokenize", "tokens")])
def test_the_other_servers_shapes_are_bounded_alike(torch_server, path, field):
    """SGLang's /generate, vLLM's /inference/v1/generate and /detokenize: the same rule, before the parse."""
    service = torch_server.server.service
    # /generate's batch may hold as many prompts as the queue admits (its bound is the highest here)
    most = 2 * service.most_body_numbers(sequences=service.limits.max_queue_requests, score_ids=False)
    ids = ",".join(["7"] * (most + 1))  # one number past it: under the body size limit
    extra = {"/generate": '"sampling_params": {"max_new_tokens": 0}, "return_logprob": true,',
             "/inference/v1/generate": '"sampling_params": {"max_tokens": 1, "prompt_logprobs": 0},'}.get(path, "")
    body = f'{{{extra} "{field}": [{ids}]}}'.encode()
    started = time.perf_counter()
    answer = httpx.post(torch_server.http_url + path, content=body, timeout=120,
                        headers={"content-type": "application/json"})
    assert answer.status_code in (400, 422) and "holds more than" in answer.text, answer.text
    assert time.perf_counter() - started < 5.0
