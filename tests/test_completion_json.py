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


@pytest.mark.parametrize("n", [0, 1, 3])
def test_openai_logprobs_equal_vllms_entry_by_entry_form(n):
    """OpenAI's `logprobs` written column-wise equals the dicts vLLM builds entry by entry: the actual
    token then the top-K, by id first, cut to N + 1 items, then keyed by text (two ids of one text:
    one key, first place, last value), -inf held at -9999."""
    from proctor.server.front.completion_json import _steps, openai_logprobs_json

    table = ["a", "b", "a", "c", " d", "e", "é", "\n", "b", "x", "y", "z"]  # ids 0/2 and 1/8 share a text

    def decode(token: int) -> str:
        return table[token]

    rng = np.random.default_rng(n)
    t, vocab, k = 30, len(table), 4
    ids = rng.integers(0, vocab, t)
    logprobs = rng.standard_normal(t - 1).astype(np.float32) - 3
    logprobs[2] = -np.inf
    topk_ids = np.stack([rng.permutation(vocab)[:k] for _ in range(t - 1)]).astype(np.int64)
    topk_lp = np.sort(rng.standard_normal((t - 1, k)).astype(np.float32), axis=1)[:, ::-1].copy()
    text = TokenText(_ListTokenizer(decode))
    ours = json.loads(openai_logprobs_json(decode(int(ids[0])), _steps(ids[1:], logprobs, topk_ids, topk_lp, n),
                                           ids, None, text))
    tops, values = [None], [None]
    for row in range(t - 1):
        step = {int(ids[row + 1]): float(logprobs[row])}
        for token, value in zip(topk_ids[row].tolist(), topk_lp[row].tolist(), strict=True):
            step.setdefault(token, value)  # a dict by id: the actual token keeps its place
        tops.append({decode(token): max(value, -9999.0) for i, (token, value) in enumerate(step.items()) if i <= n})
        values.append(max(float(logprobs[row]), -9999.0))
    tokens = [decode(int(token)) for token in ids]
    assert ours["tokens"] == tokens and ours["token_logprobs"] == values
    assert ours["top_logprobs"] == tops and [list(top) for top in ours["top_logprobs"][1:]] == [list(x) for x in tops[1:]]
    assert ours["text_offset"] == [sum(len(x) for x in tokens[:i]) for i in range(t)]
