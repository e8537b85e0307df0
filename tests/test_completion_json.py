"""The column-wise `prompt_logprobs` JSON is byte for byte `json.dumps` of vLLM's dict form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from proctor.server.front.completion_json import prompt_logprobs_json
from proctor.server.front.token_text import TokenText


def _dict_form(ids, logprobs, ranks, topk_ids, topk_logprobs, decode) -> list:
    """vLLM's prompt_logprobs as dicts, written entry by entry (the reference)."""
    rows: list = [None]
    for row in range(len(ids) - 1):
        actual = int(ids[row + 1])
        candidates = [int(t) for t in topk_ids[row]] if topk_ids is not None else []
        if actual in candidates:
            rank = candidates.index(actual) + 1
        else:
            rank = int(ranks[row]) if ranks is not None else len(candidates) + 1
        def floor(value: float) -> float:  # vLLM's clamp_prompt_logprobs: -inf is written as -9999.0
            return -9999.0 if value == float("-inf") else value

        entry = {str(actual): {"logprob": floor(float(logprobs[row])), "rank": rank, "decoded_token": decode(actual)}}
        for place, token in enumerate(candidates):
            entry.setdefault(str(token), {"logprob": floor(float(topk_logprobs[row][place])), "rank": place + 1,
                                          "decoded_token": decode(token)})
        rows.append(entry)
    return rows


class _ListTokenizer:
    """A tokenizer that decodes each id by a table (no Metaspace pieces, no split characters)."""

    def __init__(self, decode) -> None:
        self._decode = decode

    def decode(self, ids) -> str:
        return "".join(self._decode(token) for token in ([ids] if isinstance(ids, int) else ids))


@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("with_ranks", [True, False])
def test_column_wise_json_equals_the_dict_form(k, with_ranks):
    rng = np.random.default_rng(k)
    t, vocab = 40, 12  # a small vocabulary: the actual token is often among the top-k
    ids = rng.integers(0, vocab, t)
    logprobs = rng.standard_normal(t - 1).astype(np.float32) - 3
    logprobs[3] = -np.inf
    ranks = rng.integers(1, vocab, t - 1) if with_ranks else None
    topk_ids = np.stack([rng.permutation(vocab)[:k] for _ in range(t - 1)]).astype(np.int32) if k else None
    topk_lp = np.sort(rng.standard_normal((t - 1, k)).astype(np.float32), axis=1)[:, ::-1].copy() if k else None

    def decode(token: int) -> str:
        return ['a"', "\\", "é", "\n", " x", "<|im_end|>", "", "\u2028", "b", "c", "d", "e"][token]

    text = TokenText(_ListTokenizer(decode))
    ours = prompt_logprobs_json(ids, logprobs, ranks, topk_ids, topk_lp, text)
    expected = json.dumps(_dict_form(ids, logprobs, ranks, topk_ids, topk_lp, decode), separators=(",", ":"))
    assert ours == expected
    assert prompt_logprobs_json(ids, logprobs, ranks, topk_ids, topk_lp, text) == expected  # the table, reused


def test_a_one_token_prompt_has_only_the_null_row():
    assert prompt_logprobs_json(np.array([5]), np.zeros(0, np.float32), None, None, None, TokenText(None)) == "[null]"
