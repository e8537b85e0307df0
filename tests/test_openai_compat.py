"""The vLLM-compatible scoring surface, driven by the clients people already run: TRL's own
`VLLMClient.get_sequence_logprobs` and the `openai` package, unmodified, against a real
`proctor serve` with two torch teachers, each answer checked against an independent
transformers forward (tests/support/reference.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from support.reference import reference_rows
from support.routers import slow_router
from support.servers import engine_of, request_count, start_server

MATH, GEO = "openai/gsm8k", "hiyouga/geometry3k"
SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43], [1, 300, 2, 301, 3, 302, 4, 303]]
PROMPT_LENGTHS = [3, 1, 4]


@pytest.fixture(scope="module")
def served(two_teachers_served):
    """`proctor serve --config` with two teachers (math: the tiny teacher, geo: the other)."""
    return two_teachers_served


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, other_model_dir) -> dict:
    return {MATH: tiny_model_dir, GEO: other_model_dir}


def _check_trl(out: dict, model_dir, k: int, temperature: float = 1.0) -> None:
    for index, (ids, prompt_length) in enumerate(zip(SEQUENCES, PROMPT_LENGTHS, strict=True)):
        ref = reference_rows(model_dir, ids, prompt_length, temperature=temperature)
        want_ids, want_lps = ref.topk(k)
        assert out["logprob_token_ids"][index] == want_ids.tolist()  # rank order
        torch.testing.assert_close(torch.tensor(out["logprobs"][index], dtype=torch.float64), want_lps,
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(out["actual_logprobs"][index], dtype=torch.float64)[:, 0],
                                   ref.logprobs, rtol=0, atol=1e-5)
        assert [row[0] for row in out["actual_token_ids"][index]] == ids[prompt_length:]


def test_trls_vllm_client_scores_like_transformers_for_both_teachers(served, model_dirs):
    pytest.importorskip("vllm", reason="TRL's VLLMClient refuses to start without vLLM installed beside it")
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=served.http_url)  # /health, then /v1/models' data[0].id
    assert client.model == MATH
    _check_trl(client.get_sequence_logprobs(SEQUENCES, PROMPT_LENGTHS, top_logprobs=5), model_dirs[MATH], 5)
    client.model = GEO  # the second teacher: its key as the model name
    _check_trl(client.get_sequence_logprobs(SEQUENCES, PROMPT_LENGTHS, top_logprobs=3, chunk_size=2),
               model_dirs[GEO], 3)
    # temperature divides the teacher's logits before the log-softmax
    _check_trl(client.get_sequence_logprobs(SEQUENCES, PROMPT_LENGTHS, top_logprobs=4, temperature=0.7),
               model_dirs[GEO], 4, temperature=0.7)


def test_openai_package_completions_create(served, model_dirs, tiny_model_dir):
    from openai import OpenAI
    from transformers import AutoTokenizer

    client = OpenAI(base_url=served.http_url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MATH, GEO]
    ids, k = SEQUENCES[0], 4
    for key in (MATH, GEO):
        answer = client.completions.create(model=key, prompt=[ids], max_tokens=1, extra_body={"prompt_logprobs": k})
        choice = answer.choices[0]
        assert choice.prompt_token_ids == ids and choice.prompt_logprobs[0] is None
        assert answer.model == key and answer.usage.prompt_tokens == len(ids)
        ref = reference_rows(model_dirs[key], ids)
        want_ids, want_lps = ref.topk(k)
        everything = torch.argsort(ref.distributions, dim=-1, descending=True)
        for row, position in enumerate(choice.prompt_logprobs[1:]):
            ranked = sorted(position.items(), key=lambda item: item[1]["rank"])
            top = [(int(t), v) for t, v in ranked if v["rank"] <= k]
            assert [t for t, _ in top] == want_ids[row].tolist() and [v["rank"] for _, v in top] == list(range(1, k + 1))
            torch.testing.assert_close(torch.tensor([v["logprob"] for _, v in top], dtype=torch.float64),
                                       want_lps[row], rtol=0, atol=1e-5)
            actual = position[str(ids[row + 1])]  # always there, at its true rank
            assert actual["rank"] == everything[row].tolist().index(ids[row + 1]) + 1
            assert abs(actual["logprob"] - float(ref.logprobs[row])) <= 1e-5
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    answer = client.completions.create(model=MATH, prompt=ids, max_tokens=0, echo=True,
                                       extra_body={"prompt_logprobs": 0})
    position = answer.choices[0].prompt_logprobs[1]
    assert list(position) == [str(ids[1])] and position[str(ids[1])]["decoded_token"] == tokenizer.decode([ids[1]])
    assert answer.choices[0].text == tokenizer.decode(ids)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.http_url + "/v1/completions", json=body, timeout=30)


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 16}, "max_tokens"),
    ({"top_p": 0.9}, "top_p"),
    ({"stream": True}, "stream"),
    ({"n": 2}, "n"),
    ({"logprobs": 5}, "temperature"),  # a sampled token's log-probs: only greedy (temperature 0) generates
    ({"logprobs": -1, "temperature": 0}, "logprobs"),
    ({"prompt_logprobs": None}, "prompt_logprobs"),
    ({"prompt_logprobs": 65}, "topk"),
    ({"temperature": -1}, "temperature"),
    ({"tools": []}, "tools"),
    ({"prompt": [[1, "x"]]}, "prompt[0]"),
])
def test_anything_but_scoring_is_refused_with_a_clear_400(served, body, param):
    response = _post(served, {"model": MATH, "prompt": [[1, 2, 3]], "max_tokens": 1, "prompt_logprobs": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_unknown_model_is_404_in_openais_shape_and_health_and_models_answer(served):
    response = _post(served, {"model": "lmsys/chat", "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 1})
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "model" and error["message"].startswith("model: no teacher for key 'lmsys/chat'")  # as vLLM
    assert httpx.get(served.http_url + "/health").status_code == 200
    models = httpx.get(served.http_url + "/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MATH, 256), (GEO, 256)]
    # without `model` two teachers are ambiguous (one teacher: model may be left out, below)
    ambiguous = _post(served, {"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 1})
    assert ambiguous.status_code == 400 and ambiguous.json()["error"]["param"] == "model"


def test_one_teacher_needs_no_model_and_text_prompts_use_its_tokenizer(torch_server, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    response = httpx.post(torch_server.http_url + "/v1/completions",
                          json={"prompt": "the teacher scores", "max_tokens": 1, "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode("the teacher scores")
    ref = reference_rows(tiny_model_dir, choice["prompt_token_ids"])
    got = [position[str(t)]["logprob"] for position, t in zip(choice["prompt_logprobs"][1:],
                                                              choice["prompt_token_ids"][1:], strict=True)]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), ref.logprobs, rtol=0, atol=1e-5)


async def test_a_client_that_leaves_mid_call_withdraws_every_prompt(tiny_model_dir):
    """The server hears the disconnect (no polling) and cancels the call: its prompts leave the
    queue, counted as cancelled, none is scored, and the server keeps answering."""
    server = start_server(slow_router(tiny_model_dir, 1.0, name="slow")[0])
    try:
        engine = engine_of(server, "slow")
        body = {"max_tokens": 1, "prompt_logprobs": 1}
        passes_before = engine.forward_passes
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
            busy = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": [1, 2, 3], **body}))
            await asyncio.sleep(0.2)  # the engine is busy with it for 1 s
            queued = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": [[5, 6], [7, 8, 9]], **body}))
            await asyncio.sleep(0.2)
            queued.cancel()  # the client closes its connection
            with pytest.raises(asyncio.CancelledError):
                await queued
            assert (await busy).status_code == 200
            deadline = time.monotonic() + 5
            while request_count(server, "cancelled") < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(1.3)  # long enough for another batch, had the prompts stayed queued
            assert request_count(server, "cancelled") == 2
            assert engine.forward_passes == passes_before + 1  # the busy call's batch alone
            again = await http.post("/v1/completions", json={"prompt": [5, 6], **body})
            assert again.status_code == 200 and again.json()["choices"][0]["prompt_token_ids"] == [5, 6]
    finally:
        server.stop()


@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_trl_against_the_vllm_engine_at_its_temperature(vllm_server, tiny_model_dir, temperature):
    """The one vLLM engine applies the request's temperature on the device (its scoring pooler)."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=vllm_server.http_url)
    out = client.get_sequence_logprobs(SEQUENCES, PROMPT_LENGTHS, top_logprobs=3, temperature=temperature)
    for index, (ids, prompt_length) in enumerate(zip(SEQUENCES, PROMPT_LENGTHS, strict=True)):
        ref = reference_rows(tiny_model_dir, ids, prompt_length, temperature=temperature)
        assert out["logprob_token_ids"][index] == ref.topk(3)[0].tolist()
        torch.testing.assert_close(torch.tensor(out["actual_logprobs"][index], dtype=torch.float64)[:, 0],
                                   ref.logprobs, rtol=0, atol=1e-4)
