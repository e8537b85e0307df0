"""JSON answers: all T rows with nulls, the same bytes however they are cut into pieces, and a
large one streamed from a worker thread (its encoding never holds the event loop)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from proctor.server.common.metrics import Metrics
from proctor.server.engines.base import EngineResult
from proctor.server.front.float_text import json_items
from proctor.server.front.responses import JSON_INLINE_VALUES, Responses
from proctor.server.front.service import ScoredRequest
from proctor.server.worker.wire import encode_result

from support.reference import reference_rows
from support.scoring import sequences


def _result() -> EngineResult:
    g = torch.Generator().manual_seed(4)
    score = torch.randn(7, 3, generator=g)
    score[2, 1] = float("-inf")  # padded score_ids
    return EngineResult(
        first_row=3,
        logprobs=torch.randn(7, generator=g),
        topk_ids=torch.randint(0, 500, (7, 2), generator=g, dtype=torch.int32),
        topk_logprobs=torch.randn(7, 2, generator=g),
        score_logprobs=score,
        hidden_states=torch.randn(7, 4, generator=g).to(torch.bfloat16),
    )


def _expected(result: EngineResult, total: int) -> dict:
    """The answer as the contract states it: T rows, null before first_row and after the last."""
    def rows(values):
        return [None] * result.first_row + values + [None] * (total - result.first_row - len(values))

    score = [[None if v == float("-inf") else v for v in row] for row in result.score_logprobs.tolist()]
    return {
        "logprobs": rows(result.logprobs.tolist()),
        "topk_ids": rows(result.topk_ids.tolist()),
        "topk_logprobs": rows(result.topk_logprobs.tolist()),
        "score_logprobs": rows(score),
    }


def _float32(value):
    """JSON numbers read as float32 (what the answer's float32 scores round-trip to)."""
    if isinstance(value, list):
        return [_float32(v) for v in value]
    return float(np.float32(value)) if isinstance(value, float) else value


def test_float_text_reads_back_as_the_same_float32_at_every_magnitude():
    g = np.random.default_rng(5)
    values = (g.standard_normal(50_000) * 10.0 ** g.integers(-45, 38, 50_000)).astype(np.float32)
    edges = [0.0, -0.0, 1.0, -5.0, 10.0, 1e-5, 9.9999997e-6, 1e-6, 99999999.0, 1e9, 3.4028235e38, 1.4e-45, 0.1]
    values = np.concatenate([values[np.isfinite(values)], np.array(edges, dtype=np.float32)])
    back = np.array(json.loads("[" + json_items(values) + "]"), dtype=np.float64).astype(np.float32)
    assert np.array_equal(back, values) and np.array_equal(np.signbit(back), np.signbit(values))
    rows = np.array([[1.5, -np.inf, np.nan], [0.0, -2.25e-7, 3.0]], dtype=np.float32)
    assert json_items(rows) == "[1.5,null,null],[0.0,-2.24999994e-07,3.0]"
    assert (json_items(rows[:, :0]), json_items(rows[:0]), json_items(np.zeros(0, np.float32))) == ("[],[]", "", "")
    assert json_items(np.array([-12.5, -0.00012345, 947080960.0, 1e-7], np.float32)) == (
        "-12.5,-0.000123449994,947080960.0,1.00000001e-07")  # fixed notation for exponents -5..8


@pytest.mark.parametrize("encoded", [False, True])
def test_json_pieces_are_the_json_answer_however_it_is_cut(encoded):
    result = _result()
    scored = ScoredRequest("r", "tiny", "m", 12, encode_result(result) if encoded else result, "logprobs")
    responses = Responses(Metrics())
    whole = responses.json(scored)
    for rows_per_piece in (1, 3, 1000):
        assert b"".join(responses.json_pieces(scored, rows_per_piece=rows_per_piece)) == whole
    body = json.loads(whole)
    # Scores are written as 9 significant digits (`float_text`): each reads back as its float32.
    assert {k: _float32(body[k]) for k in _expected(result, 12)} == _expected(result, 12)
    assert (body["request_id"], body["num_tokens"], body["first_row"]) == ("r", 12, 3)
    assert body["hidden_states"]["shape"] == [7, 4] and body["hidden_states"]["dtype"] == "bfloat16"


def test_a_large_json_answer_is_streamed_and_exact(torch_server, tiny_model_dir):
    ids = sequences(1, seed=21, length=(1100, 1101))[0]
    assert len(ids) * (1 + 2 * 64) > JSON_INLINE_VALUES  # this answer takes the streamed path
    answer = httpx.post(torch_server.http_url + "/v1/score", json={"token_ids": ids, "topk": 64}, timeout=120)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    assert body["logprobs"][0] is None and len(body["logprobs"]) == len(ids)
    ref = reference_rows(tiny_model_dir, ids)
    torch.testing.assert_close(torch.tensor(body["logprobs"][1:]).double(), ref.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(body["topk_logprobs"][1:]).double(), ref.topk(64)[1], rtol=0, atol=1e-5)
