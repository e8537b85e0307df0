"""Token ids as the text vLLM reports for them: `decoded_token` in `prompt_logprobs`, OpenAI's
`tokens` and `top_logprobs` keys, and the greedy token's text.

vLLM decodes each candidate id alone, puts back the leading spaces a SentencePiece piece carries
(its `decode` drops them), and reads an id whose text ends in U+FFFD (a byte of a character split
across tokens) again in its sequence's context: the character it finishes, or "" while the
character is unfinished. `TokenText` keeps each id's text and JSON pieces in a table made once per
id (at most the vocabulary) and applies the context rule to the rare split ids one at a time, so an
answer's texts are numpy gathers, not Python work per entry.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

REPLACEMENT = "\ufffd"
# vLLM reads this many preceding tokens to finish a character split across tokens.
_CONTEXT_TOKENS = 4


def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style tokenizer (its `decode` of one
    token drops the leading space the piece carries), None for byte-level and other tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except Exception:  # a backend that cannot describe itself: decode as it is
        return None
    for part in [pre, *pre.get("pretokenizers", [])] if pre.get("type") == "Sequence" else [pre]:
        if part.get("type") == "Metaspace":
            return part.get("replacement", "\u2581")
    return None


class TokenText:
    """Token id -> the text vLLM reports for it (`decoded_token`, the OpenAI `tokens`), and the two
    constant pieces of its `prompt_logprobs` entry: the key (`"<id>":{"logprob":`) and the tail with
    its `decoded_token`, made once per id and kept (a table the size of the ids seen, at most the
    vocabulary).

    The text is vLLM's: the id decoded alone, with the leading spaces a SentencePiece piece carries
    put back; an id whose text ends in U+FFFD (part of a character split across tokens) is decoded
    again in its sequence's context (`in_context`), as vLLM does, and is "" when that character is
    still unfinished."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._marker = _space_marker(tokenizer) if tokenizer is not None else None
        self._texts = np.zeros(0, dtype=object)
        self._keys = np.zeros(0, dtype=object)
        self._tails = np.zeros(0, dtype=object)
        self._quoted = np.zeros(0, dtype=object)
        self._codes = np.zeros(0, dtype=np.int64)  # one number per distinct text (OpenAI's dict keys)
        self._code_of: dict[str, int] = {}
        self._known = np.zeros(0, dtype=bool)
        self._partial = np.zeros(0, dtype=bool)
        self._lock = threading.Lock()  # answers are built on worker threads too

    def __len__(self) -> int:
        """Ids decoded so far."""
        return int(self._known.sum())

    def decode_alone(self, token: int) -> str:
        """An id's text alone, by vLLM's rule (a subclass speaking another server's rule overrides it)."""
        if self._tokenizer is None:
            return ""
        text = self._tokenizer.decode([token]) or ""
        if self._marker is None:
            return text
        piece = self._tokenizer.convert_ids_to_tokens([token])[0] or ""
        markers = len(piece) - len(piece.lstrip(self._marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def pieces(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The key and tail pieces of `ids` (object arrays of ids' shape)."""
        with self._lock:
            self._learn(ids)
            return self._keys[ids], self._tails[ids]

    def texts(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each id's text alone, the same as JSON, and whether it is part of a split character
        (then `in_context` gives the text vLLM reports)."""
        with self._lock:
            self._learn(ids)
            return self._texts[ids], self._quoted[ids], self._partial[ids]

    def codes(self, ids: np.ndarray) -> np.ndarray:
        """One number per distinct text of `ids` (two ids of one text share it), to find texts
        that repeat without comparing strings."""
        with self._lock:
            self._learn(ids)
            return self._codes[ids]

    def code_of(self, text: str) -> int:
        """The number of a text read in context (a split character's), numbered as `codes` numbers."""
        with self._lock:
            return self._code_of.setdefault(text, len(self._code_of))

    def in_context(self, token: int, context: Sequence[int]) -> str:
        """The text of a partial `token` after the actual tokens `context` (oldest first, at most
        the last four are read): the character it finishes with the byte pieces before it, or ""
        while that character is unfinished (vLLM's rule for split characters)."""
        tokenizer, context = self._tokenizer, list(context)[-_CONTEXT_TOKENS:]
        for size in range(1, len(context) + 1):
            before = context[-size:]
            whole = tokenizer.decode([*before, token])
            if whole.endswith(REPLACEMENT):
                continue
            clean = len(before)
            while clean > 0 and tokenizer.decode([before[clean - 1]]).endswith(REPLACEMENT):
                clean -= 1
            prefix = tokenizer.decode(before[:clean]) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            common = next((i for i, (a, b) in enumerate(zip(prefix, whole, strict=False)) if a != b),
                          min(len(prefix), len(whole)))
            return whole[common:]
        return ""

    def key_piece(self, token: int) -> str:
        """The piece of a `prompt_logprobs` entry before its log-prob (a subclass writes another shape)."""
        return f'"{token}":{{"logprob":'

    def tail_piece(self, text: str) -> str:
        """The piece of a `prompt_logprobs` entry after its rank, with the id's text."""
        return f',"decoded_token":{json.dumps(text)}}}'

    def _learn(self, ids: np.ndarray) -> None:
        top = int(ids.max(initial=-1)) + 1
        if top > self._known.shape[0]:
            grow = top - self._known.shape[0]
            self._texts = np.concatenate([self._texts, np.full(grow, "", dtype=object)])
            self._keys = np.concatenate([self._keys, np.full(grow, "", dtype=object)])
            self._tails = np.concatenate([self._tails, np.full(grow, "", dtype=object)])
            self._quoted = np.concatenate([self._quoted, np.full(grow, "", dtype=object)])
            self._codes = np.concatenate([self._codes, np.zeros(grow, dtype=np.int64)])
            self._known = np.concatenate([self._known, np.zeros(grow, dtype=bool)])
            self._partial = np.concatenate([self._partial, np.zeros(grow, dtype=bool)])
        missing = np.unique(ids[~self._known[ids]]) if ids.size else ids
        for token in missing.tolist():
            text = self.decode_alone(token)
            self._texts[token] = text
            self._partial[token] = text.endswith(REPLACEMENT)
            self._keys[token] = self.key_piece(token)
            self._quoted[token] = json.dumps(text)
            self._codes[token] = self._code_of.setdefault(text, len(self._code_of))
            self._tails[token] = self.tail_piece(text)
        self._known[missing] = True


def prompt_contexts(ids: np.ndarray, positions: np.ndarray) -> list[list[int]]:
    """The actual tokens vLLM reads as context for the prompt positions given: those before each,
    back to four, never position 0 (it has no log-prob entry, so vLLM never counts it)."""
    return [ids[max(1, p - _CONTEXT_TOKENS):p].tolist() for p in positions.tolist()]


def vllm_token_texts(tokens: np.ndarray, ids: np.ndarray | None, text: TokenText, *,
                     first_position: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's text of each candidate in `tokens` [rows, n], the same as JSON, and which were read
    in context: row r is prompt position `first_position` + r of `ids` (None: a generated token,
    read with no context), each id alone, the split-character ones in their position's context
    (rare, so one at a time)."""
    texts, quoted, partial = text.texts(tokens)
    if partial.any():
        texts, quoted = texts.copy(), quoted.copy()
        rows, cols = np.nonzero(partial)
        contexts = (prompt_contexts(np.asarray(ids), rows + first_position) if ids is not None
                    else [[]] * rows.shape[0])
        for row, col, context in zip(rows.tolist(), cols.tolist(), contexts, strict=True):
            texts[row, col] = text.in_context(int(tokens[row, col]), context)
            quoted[row, col] = json.dumps(texts[row, col])
    return texts, quoted, partial
