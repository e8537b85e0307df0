"""OpenAI's completions `echo` + `logprobs` form, `/tokenize` and the per-teacher base paths, driven
by the clients that send them: lm-eval 0.4.13's own `local-completions` model (loglikelihood,
multiple choice and loglikelihood_rolling tasks from local files) against a real `proctor serve`,
equal per sample to lm-eval's own `hf` backend on the same weights; the `openai` package, each
value checked against an independent float64 forward (tests/support/reference.py)."""

from __future__ import annotations

import json
import math
import os
from urllib.parse import quote

import httpx
import pytest

from support.reference import reference_rows

MATH, GEO = "openai/gsm8k", "hiyouga/geometry3k"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def served(two_teachers_served):
    """`proctor serve --config` with two teachers (math: the tiny teacher, geo: the other)."""
    return two_teachers_served


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _vllm_text(tokenizer, token: int, context: list[int]) -> str:
    """The text vLLM 0.32 reports for `token` after the actual tokens `context`, by vLLM's own code
    (its per-token conversion, then its split-character correction)."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    (text,) = convert_ids_list_to_tokens(tokenizer, [token])
    if not text.endswith("\ufffd"):
        return text
    processor = LogprobsProcessor.__new__(LogprobsProcessor)
    processor.tokenizer = tokenizer
    return processor._correct_decoded_token(token, context)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, timeout=60)


def test_echo_logprobs_with_the_greedy_token_as_the_openai_package_reads_them(served, tiny_model_dir):
    from openai import OpenAI

    client = OpenAI(base_url=served.http_url + "/v1", api_key="unused")
    answer = client.completions.create(model=MATH, prompt=PROMPT, echo=True, logprobs=3, max_tokens=1, temperature=0)
    choice = answer.choices[0]
    ref = reference_rows(tiny_model_dir, [*PROMPT, 0], 1)  # one more row: the distribution after the prompt
    greedy = int(ref.distributions[-1].argmax())
    tokenizer = _tokenizer(tiny_model_dir)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == len(PROMPT) + 1  # the prompt, then the generated token
    want = [*ref.logprobs[: len(PROMPT) - 1].tolist(), float(ref.distributions[-1, greedy])]
    for got, expected in zip(logprobs.token_logprobs[1:], want, strict=True):
        assert abs(got - expected) <= 1e-5
    for row, top in enumerate(logprobs.top_logprobs[1:-1]):  # the actual token and the top-3, by text
        ids, values = ref.topk(3)
        context = PROMPT[max(1, row - 3):row + 1]  # vLLM's: up to four actual tokens before, never the first

        def text(token: int, context=context) -> str:
            return _vllm_text(tokenizer, token, context)

        expected = {text(PROMPT[row + 1]): float(ref.logprobs[row])}
        for i, v in zip(ids[row].tolist(), values[row].tolist(), strict=True):
            expected[text(i)] = v
        assert set(top) == set(expected) and all(abs(top[k] - expected[k]) <= 1e-5 for k in top)
    assert logprobs.tokens[-1] == _vllm_text(tokenizer, greedy, [])
    assert choice.text == tokenizer.decode(PROMPT) + tokenizer.decode([greedy])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert answer.usage.completion_tokens == 1 and answer.usage.prompt_tokens == len(PROMPT)
    # echo with max_tokens 0: the prompt alone, nothing generated
    alone_answer = client.completions.create(model=MATH, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    alone = alone_answer.choices[0]
    assert len(alone.logprobs.tokens) == len(PROMPT) and alone.text == tokenizer.decode(PROMPT)
    assert all(len(top) == 1 for top in alone.logprobs.top_logprobs[1:])  # N = 0: the actual token only
    assert alone_answer.usage.completion_tokens == 1  # vLLM counts its hidden decode step, so proctor does


def test_text_prompts_batches_and_tokenize_use_the_teachers_tokenizer(served, tiny_model_dir):
    tokenizer = _tokenizer(tiny_model_dir)
    texts = ["the cat sat", "on a mat, quietly"]
    answer = _post(served, "/v1/completions", {"model": MATH, "prompt": texts, "echo": True, "logprobs": 1,
                                                "max_tokens": 1, "temperature": 0}).json()
    for text, choice in zip(texts, answer["choices"], strict=True):
        ids = tokenizer.encode(text)
        ref = reference_rows(tiny_model_dir, [*ids, 0], 1)
        got = choice["logprobs"]["token_logprobs"][1:-1]
        assert max(abs(a - b) for a, b in zip(got, ref.logprobs[: len(ids) - 1].tolist(), strict=True)) <= 1e-5
        assert choice["text"].startswith(text)
    tokens = _post(served, "/tokenize", {"model": MATH, "prompt": texts[0], "return_token_strs": True}).json()
    assert tokens["tokens"] == tokenizer.encode(texts[0]) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 256 and tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    assert _post(served, "/detokenize", {"model": MATH, "tokens": tokens["tokens"]}).json() == {"prompt": texts[0]}
    info = httpx.get(served.http_url + f"/teachers/{quote(MATH, safe='')}/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__ and "eos_token" in info


@pytest.mark.parametrize(("body", "param"), [
    ({"logprobs": 2, "temperature": 0.7}, "temperature"),  # a sampled token is never served
    ({"logprobs": "2", "temperature": 0}, "logprobs"),
    ({"echo": True, "max_tokens": 0, "logprobs": 65}, "topk"),
    ({"max_tokens": 2, "temperature": 0}, "max_tokens"),
])
def test_echo_form_refusals_name_the_parameter(served, body, param):
    response = _post(served, "/v1/completions", {"model": MATH, "prompt": PROMPT, "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_each_teacher_at_its_own_base_path(served, tiny_model_dir, other_model_dir):
    """`/teachers/{key}/...`: lm-eval's base_url or an SGLang caller reaches one teacher; a body
    naming another teacher than its path is refused; models and health speak of that teacher."""
    for key, model_dir in ((MATH, tiny_model_dir), (GEO, other_model_dir)):
        base = f"{served.http_url}/teachers/{quote(key, safe='')}"
        answer = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0},
                            timeout=60).json()
        got = [next(iter(row.values()))["logprob"] for row in answer["choices"][0]["prompt_logprobs"][1:]]
        ref = reference_rows(model_dir, PROMPT, 1)
        assert max(abs(a - b) for a, b in zip(got, ref.logprobs.tolist(), strict=True)) <= 1e-5
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == [key]
        assert httpx.get(base + "/health").status_code == 200
    clash = httpx.post(f"{served.http_url}/teachers/{quote(MATH, safe='')}/v1/completions",
                       json={"model": GEO, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}, timeout=30)
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "model"
    unknown = httpx.get(f"{served.http_url}/teachers/nobody/v1/models")
    assert unknown.status_code == 404
    scored = httpx.post(f"{served.http_url}/teachers/{quote(GEO, safe='')}/v1/score", json={"token_ids": PROMPT, "logprobs": True},
                        timeout=30).json()
    ref = reference_rows(other_model_dir, PROMPT, 1)
    assert max(abs(a - b) for a, b in zip(scored["logprobs"][1:], ref.logprobs.tolist(), strict=True)) <= 1e-5
    metrics = httpx.get(served.http_url + "/metrics").text
    assert 'surface="openai_completions"' in metrics and 'surface="proctor_http"' in metrics


# -- lm-eval, unmodified -----------------------------------------------------------------------------

_DOCS = {
    "mc": [{"question": "Which is a colour?", "choices": [" red", " dog", " seven"], "answer": 0},
           {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
           {"question": "The sky at noon is", "choices": [" blue", " green", " loud", " é"], "answer": 0}],
    "ll": [{"context": "The cat sat on the", "continuation": " mat"},
           {"context": "Numbers: 1 2 3", "continuation": " 4 5"}],
    "roll": [{"text": "A short page of text for a rolling log-likelihood, long enough to need two windows "
                      "when the window is small: the quick brown fox jumps over the lazy dog, again and again."}],
}
_TASKS = {
    "mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
           "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]},
    "ll": {"output_type": "loglikelihood", "doc_to_text": "{{context}}", "doc_to_target": "{{continuation}}",
           "metric_list": [{"metric": "acc"}]},
    "roll": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
             "metric_list": [{"metric": "word_perplexity"}]},
}


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory):
    """Three lm-eval tasks over local JSONL files (no hub): multiple choice, loglikelihood, rolling."""
    pytest.importorskip("lm_eval")
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs in _DOCS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        task = {"task": f"proctor_{name}", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", **_TASKS[name]}
        (folder / f"{name}.yaml").write_text(json.dumps(task))
    return folder


def _evaluate(model: str, model_args: str, folder) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    results = simple_evaluate(model=model, model_args=model_args, tasks=[f"proctor_{n}" for n in _DOCS],
                              task_manager=TaskManager(include_path=str(folder)), log_samples=True, batch_size=1,
                              device="cpu")
    return {name: [sample["resps"] for sample in sorted(samples, key=lambda s: s["doc_id"])]
            for name, samples in results["samples"].items()}


def test_lm_evals_local_completions_equals_its_hf_backend_per_sample(served, tiny_model_dir, lm_eval_tasks):
    """lm-eval's own runs: through proctor (its vLLM-server client, the remote tokenizer proctor's
    /tokenize) and in-process with transformers; every sample's log-likelihood and greedy flag equal."""
    window = 96
    ours = _evaluate("local-completions", f"model={MATH},base_url={served.http_url}/teachers/{quote(MATH, safe='')}/v1/completions,"
                     f"num_concurrent=2,max_retries=1,tokenized_requests=True,max_length={window}", lm_eval_tasks)
    # lm-eval's API models keep max_length - 1 (one token for the generated one) and cut rolling windows
    # one shorter again; its hf backend cuts them at max_length: the hf run is given two less, so both
    # score the same windows (a difference of lm-eval's, not of the server's).
    theirs = _evaluate("hf", f"pretrained={tiny_model_dir},dtype=float32,max_length={window - 2}", lm_eval_tasks)
    assert set(ours) == set(theirs) == {f"proctor_{n}" for n in _DOCS}
    compared = 0
    for task, samples in theirs.items():
        assert len(ours[task]) == len(samples)
        for mine, reference in zip(ours[task], samples, strict=True):
            assert len(mine) == len(reference)  # one answer per request (choice, window)
            for (got,), (want,) in zip(mine, reference, strict=True):
                got_ll, want_ll = (got[0], want[0]) if isinstance(got, (list, tuple)) else (got, want)
                assert math.isfinite(got_ll) and abs(got_ll - want_ll) <= 1e-4 * max(1.0, abs(want_ll)), (task, got, want)
                if isinstance(got, (list, tuple)):
                    assert bool(got[1]) == bool(want[1]), (task, got, want)  # lm-eval's is_greedy
                compared += 1
    assert compared >= 12


def test_a_split_character_reads_as_vllm_reads_it(served, tiny_model_dir):
    """A token that is part of a UTF-8 character: its `decoded_token` is "" until the character is
    whole, then the character (vLLM's rule), never U+FFFD."""
    tokenizer = _tokenizer(tiny_model_dir)
    ids = tokenizer.encode("x 漢字 y")
    alone = [tokenizer.decode([i]) for i in ids]
    if not any(text.endswith("\ufffd") for text in alone):
        pytest.skip("the tiny tokenizer holds these characters whole")
    answer = _post(served, "/v1/completions", {"model": MATH, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}).json()
    texts = [row[str(token)]["decoded_token"] for row, token in zip(answer["choices"][0]["prompt_logprobs"][1:], ids[1:],
                                                                      strict=True)]
    assert "\ufffd" not in "".join(texts)
    assert "".join(texts) == tokenizer.decode(ids[1:])
