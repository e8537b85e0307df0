"""SGLang's native `/generate` on proctor's HTTP port, called as its users' trainers call it: slime's
and miles's OPD teacher request (`--opd-type sglang`: `on_policy_distillation.reward_func`, sent
with aiohttp exactly as slime sends it, and read by slime's own post-processing expression),
slime's multi-teacher `mopd` request, AReaL's SGLang request shape asking one greedy token, and
the variants other clients add (logprob_start_len, top_logprobs_num, token_ids_logprob,
return_text_in_logprobs, return_hidden_states, batches, text prompts, image_data). Every number is
checked against the independent float64 transformers forward (tests/support/reference.py, and
tests/support/multimodal.py for the image teacher). SGLang itself does not install here (it pins
its own torch, transformers and CUDA wheels), so its client classes are not used: the requests
are the clients' literal payloads, the answers' shapes those SGLang 0.5's tokenizer manager
writes (`meta_info`'s keys, `[logprob, token_id, text-or-null]` entries, the first position's
log-prob null)."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
import torch

from support.reference import reference_model, reference_rows
from support.servers import start_server

ATOL = 1e-5
IDS = [5, 6, 7, 8, 9, 10, 11, 300, 2, 301]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec

    server = start_server(single_teacher_router(EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=64),
                                                name="tiny"))
    yield server
    server.stop()


def _post(server, body: dict, path: str = "/generate") -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, timeout=60)


def _generate(server, body: dict):
    answer = _post(server, body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _next_row(model_dir, ids: list[int]) -> torch.Tensor:
    """The reference's distribution of the token after `ids` (float64 [V])."""
    return reference_rows(model_dir, [*ids, 0], len(ids)).distributions[0]


def _slime_payload(tokens: list[int], temperature: float = 0.8) -> dict:
    """slime's `on_policy_distillation.reward_func` (and miles's, and `mopd._build_payload`), verbatim."""
    return {
        "input_ids": tokens,
        "sampling_params": {"temperature": temperature, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


async def _slime_reward_func(url: str, payload: dict) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as resp:
        resp.raise_for_status()
        return await resp.json()


def test_slimes_opd_teacher_call_reads_the_teachers_log_probs(server, tiny_model_dir):
    reward = asyncio.run(_slime_reward_func(server.http_url + "/generate", _slime_payload(IDS)))
    # slime's post_process_rewards, as written there
    teacher_log_probs = torch.tensor([item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]],
                                     dtype=torch.float32)
    torch.testing.assert_close(teacher_log_probs.double(), reference_rows(tiny_model_dir, IDS).logprobs,
                               rtol=0, atol=ATOL)
    meta = reward["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, IDS[0], None]
    assert [entry[1] for entry in meta["input_token_logprobs"]] == IDS
    assert reward["text"] == "" and reward["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["output_token_logprobs"]) == (len(IDS), 0, [])
    assert "input_top_logprobs" not in meta and "hidden_states" not in meta


def test_a_batch_of_input_ids_answers_a_list_in_order(server, tiny_model_dir):
    batch = [IDS, [40, 41, 42, 43], [1, 300, 2]]
    answers = _generate(server, {**_slime_payload(batch), "rid": "call"})
    assert [a["meta_info"]["id"] for a in answers] == ["call_0", "call_1", "call_2"]
    for ids, answer in zip(batch, answers, strict=True):
        got = torch.tensor([e[0] for e in answer["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float64)
        torch.testing.assert_close(got, reference_rows(tiny_model_dir, ids).logprobs, rtol=0, atol=ATOL)


@pytest.mark.parametrize("start", [0, 1, 4, len(IDS) - 1, len(IDS), -1])
def test_logprob_start_len_covers_the_positions_sglang_covers(server, tiny_model_dir, start):
    meta = _generate(server, {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                              "logprob_start_len": start, "top_logprobs_num": 3})["meta_info"]
    first = len(IDS) if start == -1 else start  # -1: no prompt positions
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == IDS[first:]
    if first < len(IDS):
        assert entries[0][0] is None and meta["input_top_logprobs"][0] is None
        assert len(meta["input_top_logprobs"]) == len(IDS) - first
        if first + 1 < len(IDS):
            got = torch.tensor([e[0] for e in entries[1:]], dtype=torch.float64)
            torch.testing.assert_close(got, reference_rows(tiny_model_dir, IDS, first + 1).logprobs, rtol=0, atol=ATOL)
    else:
        assert meta["input_top_logprobs"] == []
    # SGLang also answers the top-k of what follows the prompt
    values, ids = torch.topk(_next_row(tiny_model_dir, IDS), 3)
    assert [e[1] for e in meta["output_top_logprobs"][0]] == ids.tolist()
    torch.testing.assert_close(torch.tensor([e[0] for e in meta["output_top_logprobs"][0]], dtype=torch.float64),
                               values, rtol=0, atol=ATOL)


def test_top_logprobs_num_and_token_ids_logprob_with_their_text(server, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    wanted = [3, 300, 17]
    meta = _generate(server, {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                              "logprob_start_len": 2, "top_logprobs_num": 5, "token_ids_logprob": wanted,
                              "return_text_in_logprobs": True})["meta_info"]
    ref = reference_rows(tiny_model_dir, IDS, 3)
    top_ids, top_values = ref.topk(5)
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    for row, (tops, given) in enumerate(zip(meta["input_top_logprobs"][1:], meta["input_token_ids_logprobs"][1:],
                                            strict=True)):
        assert [e[1] for e in tops] == top_ids[row].tolist()
        torch.testing.assert_close(torch.tensor([e[0] for e in tops], dtype=torch.float64), top_values[row],
                                   rtol=0, atol=ATOL)
        assert [e[1] for e in given] == wanted
        torch.testing.assert_close(torch.tensor([e[0] for e in given], dtype=torch.float64),
                                   ref.distributions[row, wanted], rtol=0, atol=ATOL)
    every = [e for pos in meta["input_top_logprobs"][1:] + meta["input_token_ids_logprobs"][1:] for e in pos]
    assert all(e[2] == tokenizer.decode([e[1]]) for e in every + meta["input_token_logprobs"])
    nxt = _next_row(tiny_model_dir, IDS)
    assert [e[1] for e in meta["output_token_ids_logprobs"][0]] == wanted
    torch.testing.assert_close(torch.tensor([e[0] for e in meta["output_token_ids_logprobs"][0]], dtype=torch.float64),
                               nxt[wanted], rtol=0, atol=ATOL)


def test_areals_request_shape_gets_the_greedy_next_token(server, tiny_model_dir):
    # AReaL's SGLangBackend.build_generation_request with gconfig greedy, max_new_tokens 1
    sampling = {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 1, "temperature": 0.0, "stop_token_ids": [],
                "ignore_eos": False, "skip_special_tokens": True, "frequency_penalty": 0.0}
    answer = _generate(server, {"input_ids": IDS, "image_data": None, "sampling_params": sampling,
                                "return_logprob": True, "stream": False})
    nxt = _next_row(tiny_model_dir, IDS)
    (logprob, token, text), = answer["meta_info"]["output_token_logprobs"]
    assert token == int(nxt.argmax()) and abs(logprob - float(nxt.max())) <= ATOL and text is None
    assert answer["output_ids"] == [token] and answer["meta_info"]["completion_tokens"] == 1
    assert answer["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert answer["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1: no prompt positions
    # AReaL's parse_generation_response
    assert [x[1] for x in answer["meta_info"]["output_token_logprobs"]] == answer["output_ids"]


def test_text_prompts_use_the_teachers_tokenizer(server, tiny_model_dir):
    from transformers import AutoTokenizer

    texts = ["The cat sat on the mat.", "12 times 7 is 84"]
    answers = _generate(server, {"text": texts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                 "logprob_start_len": 0})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text, answer in zip(texts, answers, strict=True):
        ids = tokenizer.encode(text)
        assert [e[1] for e in answer["meta_info"]["input_token_logprobs"]] == ids
        got = torch.tensor([e[0] for e in answer["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float64)
        torch.testing.assert_close(got, reference_rows(tiny_model_dir, ids).logprobs, rtol=0, atol=ATOL)


@pytest.mark.parametrize("mode", [True, "last"])
def test_hidden_states_are_the_last_layers_per_prompt_position(server, tiny_model_dir, mode):
    meta = _generate(server, {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0},
                              "return_hidden_states": mode})["meta_info"]
    model = reference_model(tiny_model_dir)
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([IDS]), output_hidden_states=True).hidden_states[-1][0]
    got = torch.tensor(meta["hidden_states"][0])
    if mode == "last":
        want = want[-1]
    assert got.shape == want.shape  # SGLang: [[position][hidden]] (True) or [[hidden]] ("last")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("body", "field"), [
    ({"sampling_params": {"max_new_tokens": 0}}, None),  # control: accepted
    ({"sampling_params": {}}, "sampling_params.max_new_tokens"),  # SGLang's default 128 is a generation
    ({"sampling_params": {"max_new_tokens": 8}}, "sampling_params.max_new_tokens"),
    ({"sampling_params": {"max_new_tokens": 1, "temperature": 0.7}}, "sampling_params.temperature"),
    ({"sampling_params": {"max_new_tokens": 0, "n": 2}}, "sampling_params.n"),
    ({"sampling_params": {"max_new_tokens": 0, "bogus": 1}}, "sampling_params.bogus"),
    ({"stream": True}, "stream"),
    ({"lora_path": "adapter"}, "lora_path"),
    ({"input_embeds": [[0.1]]}, "input_embeds"),
    ({"whatever": 1}, "whatever"),
    ({"input_ids": [[1, 2], "x"]}, "input_ids"),
    ({"input_ids": [1, 2, 1 << 40]}, "input_ids"),
    ({"input_ids": [1, 2, 9999]}, "token_ids"),  # outside the teacher's vocabulary: the rule's home names it
    ({"input_ids": []}, "input_ids"),
    ({"text": "a", "input_ids": [1, 2]}, "input_ids"),
    ({"logprob_start_len": 99, "return_logprob": True}, "logprob_start_len"),
    ({"logprob_start_len": -5, "return_logprob": True}, "logprob_start_len"),
    ({"top_logprobs_num": 65, "return_logprob": True}, "topk"),
    ({"top_logprobs_num": -1, "return_logprob": True}, "top_logprobs_num"),
    ({"token_ids_logprob": [1, 99999], "return_logprob": True}, "score_ids"),
    ({"return_hidden_states": "first"}, "return_hidden_states"),
    ({"image_data": "http://example.com/cat.png"}, "image_data[0]"),
    ({"image_data": "%%%"}, "image_data[0]"),
    ({"image_data": [base64.b64encode(b"\x89PNG not really").decode()]}, "images"),  # a text-only teacher
    ({"rid": 5}, "rid"),
])
def test_hostile_input_is_a_400_naming_the_field_in_sglangs_shape(server, body, field):
    answer = _post(server, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}, **body})
    if field is None:
        assert answer.status_code == 200, answer.text
        return
    assert answer.status_code == 400, answer.text
    assert list(answer.json()) == ["error"] and list(answer.json()["error"]) == ["message"]
    assert field in answer.json()["error"]["message"]


def test_sglangs_probes_and_model_info(server, tiny_model_dir):
    assert httpx.get(server.http_url + "/health").status_code == 200
    assert httpx.get(server.http_url + "/health_generate").status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(server.http_url + path).json()
        assert info["is_generation"] is True and info["tokenizer_path"] == str(tiny_model_dir)
        assert info["architectures"] == ["Qwen2ForCausalLM"]
    assert httpx.get(server.http_url + "/get_server_info").json()["context_length"] > 0


def test_with_several_teachers_the_bare_path_says_how_to_choose(two_teachers):
    answer = _post(two_teachers, _slime_payload([1, 2, 3]))
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "teacher_key" in message and "/teachers/<key>/generate" in message


def test_each_teacher_at_its_own_base_path_as_slimes_per_domain_urls(two_teachers, tiny_model_dir, other_model_dir):
    """slime's per-domain `--rm-url http://host/teachers/{key}/generate`: each reaches its teacher."""
    from urllib.parse import quote

    for key, model_dir in (("openai/gsm8k", tiny_model_dir), ("hiyouga/geometry3k", other_model_dir)):
        url = f"{two_teachers.http_url}/teachers/{quote(key, safe='')}/generate"
        reward = asyncio.run(_slime_reward_func(url, _slime_payload(IDS)))
        got = torch.tensor([item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float64)
        torch.testing.assert_close(got, reference_rows(model_dir, IDS).logprobs, rtol=0, atol=ATOL)
    metrics = httpx.get(two_teachers.http_url + "/metrics").text
    assert 'surface="sglang_generate"' in metrics


def test_slimes_call_with_an_image_on_a_vision_teacher(tmp_path_factory):
    from proctor.server.cli.tiny_multimodal import make_tiny_vl_model
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec

    from support.multimodal import Sample, png, reference, smooth_image

    model_dir = make_tiny_vl_model(tmp_path_factory.mktemp("vl"))
    image = png(smooth_image(56, 84))
    ref = reference(model_dir, Sample("User: <|vision_start|><|image_pad|><|vision_end|> what is it?", images=[image]))
    server = start_server(single_teacher_router(EngineSpec(name="torch", model_path=str(model_dir), max_topk=8),
                                                name="vl"))
    try:
        payload = {**_slime_payload(ref.ids),  # slime's encode_image_for_rollout_engine: a PNG data URL
                   "image_data": ["data:image/png;base64," + base64.b64encode(image.data).decode()]}
        reward = asyncio.run(_slime_reward_func(server.http_url + "/generate", payload))
    finally:
        server.stop()
    got = torch.tensor([item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]])
    want = ref.logprobs.gather(1, torch.tensor(ref.ids)[1:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
