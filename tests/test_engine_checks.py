"""Each startup check, provoked: the error says which setting to change."""

from __future__ import annotations

import pytest

from proctor.server.engines.base import EngineConfigError, EngineSpec
from proctor.server.engines.checks import (
    check_batched_tokens,
    check_engine_name,
    check_hidden_states_prefill,
    check_max_logprobs,
    check_max_model_len,
    check_model_path,
    check_vllm_settings,
)
from proctor.server.engines.factory import create_engine


def test_max_model_len_must_hold_prompt_response_and_one():
    check_max_model_len(1025, 512, 512)
    with pytest.raises(EngineConfigError, match=r"max_model_len is 1024.*at least 1025"):
        check_max_model_len(1024, 512, 512)


def test_max_logprobs_must_cover_the_topk():
    check_max_logprobs(64, 64)
    with pytest.raises(EngineConfigError, match=r"engine_kwargs\.vllm\.max_logprobs is 20.*at least 64"):
        check_max_logprobs(20, 64)
    with pytest.raises(EngineConfigError, match=r"engine_kwargs\.vllm_omni\.max_logprobs"):
        check_max_logprobs(1, 2, engine="vllm_omni")


def test_hidden_states_need_chunked_prefill_off():
    check_hidden_states_prefill(False)
    with pytest.raises(EngineConfigError, match=r"enable_chunked_prefill=false"):
        check_hidden_states_prefill(True)


def test_batched_tokens_must_hold_the_longest_sequence():
    check_batched_tokens(1024, 512, 512)
    with pytest.raises(EngineConfigError, match=r"max_num_batched_tokens is 1000.*at least 1024"):
        check_batched_tokens(1000, 512, 512)


def test_unknown_engine_name():
    with pytest.raises(EngineConfigError, match=r"'sglang'.*torch, vllm, vllm_omni"):
        check_engine_name("sglang")
    with pytest.raises(EngineConfigError, match="unknown engine"):
        create_engine(EngineSpec(name="sglang", model_path="/m"))


def test_model_path_missing_or_not_a_model(tmp_path):
    with pytest.raises(EngineConfigError, match="does not exist"):
        check_model_path(tmp_path / "nowhere")
    with pytest.raises(EngineConfigError, match="is empty"):
        check_model_path("")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(EngineConfigError, match="is a file"):
        check_model_path(tmp_path / "file.bin")
    with pytest.raises(EngineConfigError, match=r"no config\.json"):
        check_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert check_model_path(tmp_path) == tmp_path


def test_settings_checks_combine_on_a_verl_inference_block():
    good = {"prompt_length": 512, "response_length": 512, "max_model_len": 2048,
            "enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    check_vllm_settings(good, topk=32, max_logprobs=64, hidden_states=True)
    with pytest.raises(EngineConfigError, match="max_model_len"):
        check_vllm_settings({**good, "max_model_len": 1000}, topk=32, max_logprobs=64, hidden_states=False)
    with pytest.raises(EngineConfigError, match="max_logprobs"):
        check_vllm_settings(good, topk=128, max_logprobs=64, hidden_states=False)
    with pytest.raises(EngineConfigError, match="enable_chunked_prefill"):
        check_vllm_settings({**good, "enable_chunked_prefill": True}, topk=8, max_logprobs=8, hidden_states=True)
    with pytest.raises(EngineConfigError, match="max_num_batched_tokens"):
        check_vllm_settings({**good, "max_num_batched_tokens": 512}, topk=8, max_logprobs=8, hidden_states=True)
    # chunked prefill is fine when no hidden states are served
    check_vllm_settings({**good, "enable_chunked_prefill": True}, topk=8, max_logprobs=8, hidden_states=False)


async def test_vllm_engine_runs_the_checks_before_starting(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 8, "hidden_size": 64, "num_attention_heads": 2}')
    spec = EngineSpec(
        name="vllm", model_path=str(tmp_path), max_topk=64,
        inference={"engine_kwargs": {"vllm": {"max_logprobs": 8}}},
    )
    with pytest.raises(EngineConfigError, match="max_logprobs is 8"):
        await create_engine(spec).start()
    spec = EngineSpec(
        name="vllm", model_path=str(tmp_path / "missing"), max_topk=8, inference={}
    )
    with pytest.raises(EngineConfigError, match="does not exist"):
        await create_engine(spec).start()
    # Hidden states come from the scoring pooler, which keeps each prefill chunk's outputs, so
    # a vLLM teacher's chunked-prefill setting is no reason to refuse them (vLLM-Omni's is).
