"""vLLM's `prompt_logprobs` JSON, written column by column with numpy's string ufuncs.

A `/v1/completions` answer with `prompt_logprobs=K` holds (K + 1) entries per token
(`"<id>": {"logprob": x, "rank": r, "decoded_token": "..."}`): building a dict per entry and
`json.dumps` of the whole was the endpoint's main cost. Here every field is formatted for all
rows at once (floats and ints by numpy's shortest round-trip formatting, the same digits as
Python's `repr`; decoded tokens looked up in a table of JSON-escaped strings, one per id ever
seen), and the entries are concatenated column by column: K + 1 vectorised string operations per
answer, no Python work per entry. The text equals `json.dumps` of vLLM's dict form (the actual
token first; a top-K entry equal to it is left out, as a dict keeps the first key).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import numpy as np

_STR = np.dtypes.StringDType()


def _floats(values: np.ndarray) -> np.ndarray:
    """float32 values as Python's json writes their float64 widening."""
    wide = values.astype(np.float64)
    text = wide.astype(_STR)
    text = np.where(np.isneginf(wide), "-Infinity", text)
    text = np.where(np.isposinf(wide), "Infinity", text)
    return np.where(np.isnan(wide), "NaN", text).astype(_STR)


class TokenText:
    """Token id -> its `decoded_token` as a JSON string literal, decoded once per id (each id
    decoded alone, as vLLM reports it)."""

    def __init__(self, decode: Callable[[int], str]) -> None:
        self._decode = decode
        self._table = np.zeros(0, dtype=_STR)
        self._known = np.zeros(0, dtype=bool)
        self._lock = threading.Lock()  # answers are built on worker threads too

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        with self._lock:
            return self._lookup(ids)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        top = int(ids.max(initial=-1)) + 1
        if top > self._table.shape[0]:
            self._table = np.concatenate([self._table, np.full(top - self._table.shape[0], "", dtype=_STR)])
            self._known = np.concatenate([self._known, np.zeros(top - self._known.shape[0], dtype=bool)])
        missing = np.unique(ids[~self._known[ids]]) if ids.size else ids
        for token in missing.tolist():
            self._table[token] = json.dumps(self._decode(token))
        self._known[missing] = True
        return self._table[ids]


def prompt_logprobs_json(ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray | None,
                         topk_ids: np.ndarray | None, topk_logprobs: np.ndarray | None, text: TokenText) -> str:
    """One prompt's `prompt_logprobs` list as JSON: `null`, then rows 1..T-1 (`ids` [T], the
    rest per row [T-1] / [T-1, K])."""
    actual = ids[1:].astype(np.int64)
    rows = actual.shape[0]
    k = 0 if topk_ids is None else topk_ids.shape[1]
    if k:
        hit = topk_ids == actual[:, None]
        rank = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, ranks if ranks is not None else k + 1)
    else:
        rank = ranks if ranks is not None else np.ones(rows, dtype=np.int64)
    line = _entry(actual, _floats(logprobs), np.asarray(rank).astype(np.int64), text)
    for place in range(k):
        entry = _entry(topk_ids[:, place].astype(np.int64), _floats(topk_logprobs[:, place]),
                       np.full(rows, place + 1, dtype=np.int64), text)
        line = np.strings.add(line, np.where(hit[:, place], "", np.strings.add(",", entry)).astype(_STR))
    if not rows:
        return "[null]"
    return "[null,{" + "},{".join(line.tolist()) + "}]"


def _entry(tokens: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, text: TokenText) -> np.ndarray:
    parts = ('"', tokens.astype(_STR), '":{"logprob":', logprobs, ',"rank":', ranks.astype(_STR),
             ',"decoded_token":', text.lookup(tokens), "}")
    out = np.asarray(parts[0], dtype=_STR)
    for part in parts[1:]:
        out = np.strings.add(out, part)
    return out
