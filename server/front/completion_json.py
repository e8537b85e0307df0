"""vLLM's `prompt_logprobs` JSON, assembled from per-column string pieces in one join.

A `/v1/completions` answer with `prompt_logprobs=K` holds (K + 1) entries per token
(`"<id>":{"logprob":x,"rank":r,"decoded_token":"..."}`): building a dict per entry and
`json.dumps` of the whole was the endpoint's main cost, and so was, after it, formatting every
field with numpy's string ufuncs (their float formatting and the per-operation copies of a
growing StringDType line cost ~2 µs an entry, 140 µs a scored top-64 token). Here an entry is
four pieces in an object array: the id's key (`"<id>":{"logprob":`) and its tail
(`,"decoded_token":"..."}`) from a table built once per id, the log-prob as Python's float repr
(what `json.dumps` writes), and the rank's piece; the pieces of every kept entry are joined
once. No Python bytecode runs per entry. The text equals `json.dumps` of vLLM's dict form (the
actual token first; a top-K entry equal to it is left out, as a dict keeps the first key).

`completion_answer` is the whole `/v1/completions` answer around those lists; `Responses`
builds it (and counts its bytes) like every other answer.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from proctor.server.front.service import ScoredRequest

# Rows formatted per join: one join of ~5 pieces an entry holds the GIL for a few ms at most,
# so an answer built on a worker thread leaves the event loop its turns.
_ROWS_PER_PIECE = 256


def float_texts(values: np.ndarray) -> np.ndarray:
    """float32 values as json.dumps writes their float64 widening (an object array of str)."""
    wide = values.astype(np.float64).ravel()
    out = np.empty(wide.shape[0], dtype=object)
    out[:] = list(map(float.__repr__, wide.tolist()))
    odd = np.flatnonzero(~np.isfinite(wide))
    for index in odd.tolist():  # JSON's spellings (json.dumps' allow_nan), rare: masked entries
        value = wide[index]
        out[index] = "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return out.reshape(values.shape)


class TokenText:
    """Token id -> the two constant pieces of its entry: the key (`"<id>":{"logprob":`) and the
    tail with its `decoded_token` (each id decoded alone, as vLLM reports it), made once per id
    and kept (a table the size of the ids seen, at most the vocabulary)."""

    def __init__(self, decode: Callable[[int], str]) -> None:
        self._decode = decode
        self._keys = np.zeros(0, dtype=object)
        self._tails = np.zeros(0, dtype=object)
        self._known = np.zeros(0, dtype=bool)
        self._lock = threading.Lock()  # answers are built on worker threads too

    def __len__(self) -> int:
        """Ids decoded so far."""
        return int(self._known.sum())

    def pieces(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The key and tail pieces of `ids` (object arrays of ids' shape)."""
        with self._lock:
            self._learn(ids)
            return self._keys[ids], self._tails[ids]

    def _learn(self, ids: np.ndarray) -> None:
        top = int(ids.max(initial=-1)) + 1
        if top > self._known.shape[0]:
            grow = top - self._known.shape[0]
            self._keys = np.concatenate([self._keys, np.full(grow, "", dtype=object)])
            self._tails = np.concatenate([self._tails, np.full(grow, "", dtype=object)])
            self._known = np.concatenate([self._known, np.zeros(grow, dtype=bool)])
        missing = np.unique(ids[~self._known[ids]]) if ids.size else ids
        for token in missing.tolist():
            self._keys[token] = self.key_piece(token)
            self._tails[token] = self.tail_piece(self._decode(token))
        self._known[missing] = True

    def key_piece(self, token: int) -> str:
        """The piece of an entry before its log-prob's text (a subclass writes another shape)."""
        return f'"{token}":{{"logprob":'

    def tail_piece(self, text: str) -> str:
        """The piece of an entry after its rank, with the id's decoded text."""
        return f',"decoded_token":{json.dumps(text)}}}'


def prompt_logprobs_json(ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray | None,
                         topk_ids: np.ndarray | None, topk_logprobs: np.ndarray | None, text: TokenText) -> str:
    """One prompt's `prompt_logprobs` list as JSON: `null`, then rows 1..T-1 (`ids` [T], the
    rest per row [T-1] / [T-1, K])."""
    actual = np.asarray(ids)[1:].astype(np.int64)
    rows = actual.shape[0]
    if not rows:
        return "[null]"
    k = 0 if topk_ids is None else topk_ids.shape[1]
    tokens = np.empty((rows, k + 1), dtype=np.int64)
    tokens[:, 0] = actual
    values = np.empty((rows, k + 1), dtype=np.float32)
    values[:, 0] = logprobs
    keep = np.ones((rows, k + 1), dtype=bool)
    if k:
        tokens[:, 1:] = topk_ids
        values[:, 1:] = topk_logprobs
        hit = topk_ids == actual[:, None]
        rank = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, ranks if ranks is not None else k + 1)
        keep[:, 1:] = ~hit
    else:
        rank = ranks if ranks is not None else np.ones(rows, dtype=np.int64)
    rank_pieces = np.empty((rows, k + 1), dtype=object)
    rank_pieces[:, 1:] = np.asarray([f',"rank":{place}' for place in range(1, k + 1)], dtype=object)
    rank_pieces[:, 0] = [f',"rank":{r}' for r in np.asarray(rank).astype(np.int64).tolist()]
    out = []
    for start in range(0, rows, _ROWS_PER_PIECE):
        stop = min(rows, start + _ROWS_PER_PIECE)
        keys, tails = text.pieces(tokens[start:stop])
        entry = np.empty((stop - start, k + 1, 5), dtype=object)
        entry[:, :, 0] = ","
        entry[:, 0, 0] = "},{"
        entry[:, :, 1] = keys
        entry[:, :, 2] = float_texts(values[start:stop])
        entry[:, :, 3] = rank_pieces[start:stop]
        entry[:, :, 4] = tails
        out.append("".join(entry[keep[start:stop]].ravel().tolist()))
    return "[null," + "".join(out)[2:] + "}]"


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def completion_answer(prompts: Sequence[list[int]], scored: Sequence[ScoredRequest], *, model: str,
                      echo: Callable[[list[int]], str] | None, text: TokenText) -> bytes:
    """The whole `/v1/completions` answer, serialised, as vLLM shapes it; the prompt log-probs are
    written column-wise (`prompt_logprobs_json`), the rest by `json.dumps`. With `echo` each
    choice's `text` is its prompt decoded (here too, so that a large answer's decoding is off
    the loop with the rest)."""
    choices = []
    for index, (ids, score) in enumerate(zip(prompts, scored, strict=True)):
        head = {"index": index, "text": echo(ids) if echo is not None else "", "logprobs": None,
                "finish_reason": "length", "stop_reason": None}
        result = score.result
        rows = prompt_logprobs_json(
            np.asarray(ids, dtype=np.int64), result.logprobs.numpy(),
            None if result.ranks is None else result.ranks.numpy(),
            None if result.topk_ids is None else result.topk_ids.numpy(),
            None if result.topk_logprobs is None else result.topk_logprobs.numpy(), text)
        choices.append(f'{_dumps(head)[:-1]},"prompt_logprobs":{rows},"prompt_token_ids":{_dumps(ids)}}}')
    tokens = sum(len(ids) for ids in prompts)
    top = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    return f'{_dumps(top)[:-1]},"choices":[{",".join(choices)}],"usage":{_dumps(usage)}}}'.encode()
