"""The scoring parts without a vLLM engine: the pooler's answer format, the one row-scoring rule
against a float64 log-softmax, vLLM-Omni's hidden-state score_ids (and its refusal where logits are
not h·Wᵀ), and vLLM-Omni's wiring through a recorded AR-stage output."""

from __future__ import annotations

import pytest
import torch
from test_vllm_omni_engine import _fake_omni_output, _faked_start, _omni_spec, _request

from proctor.server.engines.base import EngineError, EngineRequest
from proctor.server.engines.row_scores import score_rows
from proctor.server.engines.score_ids import FROM_HIDDEN, scores_from_hidden
from proctor.server.engines.vllm.pooled_scores import ScoreAsk, pack, unpack
from proctor.server.engines.vllm_omni.engine import VllmOmniEngine


def test_the_pooler_answer_round_trips_every_section():
    """What the scoring pooler packs in vLLM's worker is what the replica worker reads, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    n, k, ks, h, v = 5, 3, 2, 4, 11
    parts = dict(logprobs=torch.randn(n, generator=generator), ranks=torch.randint(1, 9, (n,), dtype=torch.int32),
                 topk_ids=torch.randint(0, v, (n, k), dtype=torch.int32), topk_logprobs=torch.randn(n, k),
                 score_logprobs=torch.randn(n, ks), hidden=torch.randn(n, h).to(torch.bfloat16),
                 kept_logits=torch.randn(v), kept_hidden=torch.randn(h))
    answer = unpack(pack(7, n, **parts, positions=12, device=torch.device("cpu")))
    assert (answer.first_row, answer.n, answer.positions) == (7, n, 12)
    for name, value in parts.items():
        assert torch.equal(getattr(answer, name), value.to(getattr(answer, name).dtype)), name
    assert answer.hidden.dtype == torch.bfloat16
    bare = unpack(pack(3, 0, logprobs=None, ranks=None, topk_ids=None, topk_logprobs=None, score_logprobs=None,
                       hidden=None, kept_logits=None, kept_hidden=None, positions=1, device=torch.device("cpu")))
    assert bare.logprobs is None and bare.hidden is None and bare.first_row == 3
    # Log-probs without ranks (what every request but /v1/completions' asks): no rank section.
    unranked = unpack(pack(7, n, **{**parts, "ranks": None}, positions=12, device=torch.device("cpu")))
    assert unranked.ranks is None and torch.equal(unranked.logprobs, parts["logprobs"])
    assert torch.equal(unranked.score_logprobs, parts["score_logprobs"])
    with pytest.raises(ValueError, match="header"):
        unpack(torch.zeros(8, dtype=torch.uint8))
    ask = ScoreAsk(first_row=4, topk=2, temperature=0.7, hidden=True, score_ids=b"\x01\x00\x00\x00" * 4,
                   score_k=2, keep_row=4, ranks=True)
    assert ScoreAsk.from_kwargs(ask.to_kwargs()) == ask
    assert ask.score_ids_tensor(2).tolist() == [[1, 1], [1, 1]]
    with pytest.raises(ValueError, match="extra_kwargs"):
        ScoreAsk.from_kwargs({})


def test_row_scores_equal_a_float64_log_softmax_at_any_temperature():
    generator = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 6, generator=generator), torch.randn(40, 6, generator=generator)
    targets = torch.randint(0, 40, (9,), generator=generator)
    temperatures = torch.tensor([1.0, 0.7, 2.0] * 3)
    score_ids = torch.randint(0, 40, (9, 3), generator=generator)
    score_ids[0, 2] = -1
    scores = score_rows(lambda h: h @ weight.T, hidden, targets, topk=4, temperatures=temperatures,
                        score_ids=score_ids, chunk_rows=4)
    logp = torch.log_softmax((hidden.double() @ weight.double().T) / temperatures.double()[:, None], dim=-1)
    actual = logp.gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(scores.logprobs.double(), actual, rtol=0, atol=1e-5)
    assert torch.equal(scores.ranks.long(), (logp > actual[:, None]).sum(1) + 1)
    unranked = score_rows(lambda h: h @ weight.T, hidden, targets, topk=4, temperatures=temperatures,
                          score_ids=score_ids, chunk_rows=4, ranks=False)
    assert unranked.ranks is None and torch.equal(unranked.logprobs, scores.logprobs)
    assert score_rows(lambda h: h @ weight.T, hidden[:0], targets[:0], ranks=False).ranks is None
    values, ids = torch.topk(logp, 4)
    assert torch.equal(scores.topk_ids.long(), ids)
    torch.testing.assert_close(scores.topk_logprobs.double(), values, rtol=0, atol=1e-5)
    expected = logp.gather(1, score_ids.clamp_min(0)).masked_fill(score_ids < 0, float("-inf"))
    torch.testing.assert_close(scores.score_logprobs.double(), expected, rtol=0, atol=1e-5)


def test_omni_serves_no_score_ids_for_logits_it_cannot_rebuild(tmp_path):
    """The hidden-state method assumes logits = h·Wᵀ: a soft-capped teacher gets none, not wrong ones."""
    from proctor.server.cli.tiny_model import make_tiny_model

    plain = VllmOmniEngine(_omni_spec())
    plain.spec = plain.spec.__class__(**{**plain.spec.__dict__, "model_path": str(make_tiny_model(tmp_path / "q"))})
    plain.sub_config = ()
    assert plain._choose_score_ids_method() == FROM_HIDDEN
    capped = VllmOmniEngine(_omni_spec())
    capped.spec = plain.spec.__class__(**{**plain.spec.__dict__,
                                          "model_path": str(make_tiny_model(tmp_path / "g", family="gemma2"))})
    capped.sub_config = ()
    assert capped._choose_score_ids_method() == ""


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
    _faked_start(engine, RecordingOmni(), torch.float32)
    engine._unembedding = weight
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
