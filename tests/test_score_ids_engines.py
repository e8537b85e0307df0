"""The vLLM engines' score_ids parts without a vLLM engine: the method choice, vLLM's fixed-token
arguments and answer, the hidden-state method against a float64 log-softmax, and vLLM-Omni's
wiring through a recorded AR-stage output."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_vllm_omni_engine import _fake_omni_output, _omni_spec, _request

from proctor.server.engines.base import EngineError, EngineRequest
from proctor.server.engines.score_ids import (
    FIXED_TOKENS,
    FROM_HIDDEN,
    choose_method,
    fixed_token_kwargs,
    fixed_token_rows,
    scores_from_hidden,
)
from proctor.server.engines.vllm_omni_engine import VllmOmniEngine


def _config(v2: bool, device: str = "cuda", fast_prefill: bool = False) -> SimpleNamespace:
    return SimpleNamespace(use_v2_model_runner=v2, device_config=SimpleNamespace(device_type=device),
                           cache_config=SimpleNamespace(kv_sharing_fast_prefill=fast_prefill))


def test_the_method_is_vllms_fixed_token_scoring_only_where_its_runner_has_it():
    assert choose_method(_config(True), serves_hidden_states=True) == FIXED_TOKENS
    assert choose_method(_config(True), serves_hidden_states=False) == FIXED_TOKENS
    for config in (_config(False), _config(True, "cpu"), _config(True, fast_prefill=True), SimpleNamespace()):
        assert choose_method(config, serves_hidden_states=True) == FROM_HIDDEN
        assert choose_method(config, serves_hidden_states=False) == ""
    assert choose_method(_config(True), serves_hidden_states=True, setting=FROM_HIDDEN) == FROM_HIDDEN
    with pytest.raises(EngineError, match="runner v2"):
        choose_method(_config(False), serves_hidden_states=True, setting=FIXED_TOKENS)
    with pytest.raises(EngineError, match="without hidden states"):
        choose_method(_config(True), serves_hidden_states=False, setting=FROM_HIDDEN)
    with pytest.raises(EngineError, match="score_ids_method"):
        choose_method(_config(True), serves_hidden_states=True, setting="guess")


def _with_ids(ids: list[int], first_row: int, score_ids: list[list[int]]) -> EngineRequest:
    return EngineRequest(request_id="r", token_ids=torch.tensor(ids), first_row=first_row, logprobs=False, topk=0,
                         hidden_states=False, score_ids=torch.tensor(score_ids))


def test_fixed_token_arguments_and_answer_follow_vllms_row_convention():
    request = _with_ids([5, 6, 7, 8, 9], 3, [[1, 2, -1], [4, -1, -1]])
    kwargs = fixed_token_kwargs(request)
    # vLLM: row i scores prompt token prompt_logprob_start + i + 1, so start = first_row - 1.
    assert kwargs["prompt_logprob_start"] == 2
    assert kwargs["prompt_logprob_token_ids"].dtype == np.int32
    assert kwargs["prompt_logprob_token_ids"].tolist() == [[1, 2, -1], [4, -1, -1]]
    answer = SimpleNamespace(prompt_token_id_logprobs=np.array([[-1.0, -2.0, -np.inf], [-3.0, -np.inf, -np.inf]]))
    rows = fixed_token_rows(answer, request)
    assert rows.dtype == torch.float32 and rows.tolist() == [[-1.0, -2.0, float("-inf")], [-3.0] + [float("-inf")] * 2]
    with pytest.raises(EngineError, match="shape"):
        fixed_token_rows(SimpleNamespace(prompt_token_id_logprobs=np.zeros((3, 3))), request)
    with pytest.raises(EngineError, match="prompt_token_id_logprobs"):
        fixed_token_rows(SimpleNamespace(), request)
    assert fixed_token_kwargs(_with_ids([1, 2], 1, [[0]]).__class__(
        request_id="r", token_ids=torch.tensor([1, 2]), first_row=1, logprobs=True, topk=0, hidden_states=False)) == {}


def test_scores_from_hidden_equal_the_full_log_softmax():
    torch.manual_seed(0)
    rows, hidden_size, vocab, k = 37, 48, 300, 9
    hidden = torch.randn(rows, hidden_size) * 2
    weight = torch.randn(vocab, hidden_size)
    full = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1)
    actual = torch.randint(0, vocab, (rows,))
    ids = torch.randint(0, vocab, (rows, k))
    ids[::4, -3:] = -1
    # The actual token's log-prob as an engine sends it: float32, rounded from an exact value.
    actual_lp = full.gather(1, actual[:, None]).squeeze(1).float()
    got = scores_from_hidden(hidden, weight, ids, actual, actual_lp)
    expected = full.gather(1, ids.clamp_min(0)).masked_fill(ids < 0, float("-inf"))
    assert got.dtype == torch.float32 and torch.equal(torch.isinf(got), ids < 0)
    torch.testing.assert_close(got.double()[ids >= 0], expected[ids >= 0], rtol=1e-6, atol=1e-5)
    with pytest.raises(EngineError, match="rows"):
        scores_from_hidden(hidden[:-1], weight, ids, actual, actual_lp)


async def test_omni_scores_ids_from_its_ar_stage_hidden_states():
    ids = [3, 9, 4, 5, 6]
    states = torch.randn(5, 4)
    weight = torch.randn(128, 4)

    class RecordingOmni:
        async def generate(self, prompt, request_id, sampling_params_list=None):
            yield _fake_omni_output(prompt["prompt_token_ids"], [states])

    engine = VllmOmniEngine(_omni_spec())
    engine._omni, engine._started, engine._dtype, engine._unembedding = RecordingOmni(), True, torch.float32, weight
    engine.score_ids_method = FROM_HIDDEN
    score_ids = torch.tensor([[7, 1], [2, -1], [100, 3]])
    request = _request("o", ids)
    (res,) = await engine.score([EngineRequest(**{**request.__dict__, "score_ids": score_ids})])
    # The fake stage says log p(actual token at row i) = -i; rows 2..4 come from positions 1..3.
    h = states[1:4]
    lse = (h * weight[torch.tensor(ids[2:])]).sum(1) + torch.tensor([2.0, 3.0, 4.0])
    expected = (h @ weight.T).gather(1, score_ids.clamp_min(0)) - lse[:, None]
    expected = expected.masked_fill(score_ids < 0, float("-inf"))
    torch.testing.assert_close(res.score_logprobs, expected)
    assert res.hidden_states is None  # computed from them, not sent unless asked
