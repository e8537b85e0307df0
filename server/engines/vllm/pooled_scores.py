"""What one scoring request asks of vLLM's scoring pooler, and the compact answer it gets back.

Both halves live here, with no vLLM import, because they run in two processes: the ask is
written by the vLLM engine (replica worker) into `PoolingParams.extra_kwargs["proctor"]`, read
by the pooler (`vllm.scoring_model`, inside vLLM's model worker); the answer is packed there
into one uint8 tensor (vLLM's pooling output travels as a tensor per request) and unpacked in
the replica worker as zero-copy views.

The answer's layout: a header of int64 fields, then each present section's raw bytes, in order:
log-probs float32 [n], ranks int32 [n] (when asked), top-k ids int32 [n, K], top-k log-probs float32 [n, K],
score log-probs float32 [n, Ks], hidden states [n, H] in the model's dtype, and one row's record
(`keep_row`): its raw logits float32 [V] and its hidden state float32 [H], what a shared prompt's
followers need of row P. Rows are `first_row .. first_row+n-1`
of proctor's convention (row i from position i-1); `first_row` says which rows the pooler
could compute: with c prefix-cached tokens it saw positions c.. only; `positions` counts the
positions it saw (vLLM's computed tokens for the request, measured where they ran).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KEY = "proctor"
MAGIC = 0x50524F43  # "PROC"
VERSION = 3
# int64 fields: magic, version, first_row, n, scores (bit 0: log-probs, bit 1: ranks), K, Ks, H, hidden dtype,
# kept row's V and H, positions
_HEADER = 12
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)  # uint8: packed fp8 rows


@dataclass(frozen=True)
class ScoreAsk:
    """One request's asks: rows `first_row..T-1`; `scores` (log-probs, plus `topk` and
    `score_ids`, and the actual tokens' `ranks`) at `temperature`; `hidden` states; `keep_row`
    (0: none): that row's raw logits and hidden state, also past the rows asked (row T of a
    prompt sent alone has no token)."""

    first_row: int
    scores: bool = True
    topk: int = 0
    temperature: float = 1.0
    hidden: bool = False
    score_ids: bytes = b""  # int32 [rows, score_k], row-major, -1 padding
    score_k: int = 0
    keep_row: int = 0
    hidden_form: str = ""  # the hidden states' wire form (`engines.hidden_forms`), made in the pooler
    projection: str = ""  # the file of the teacher's projection P, for the projected forms
    ranks: bool = False

    def to_kwargs(self) -> dict[str, Any]:
        return {KEY: [self.first_row, self.scores, self.topk, self.temperature, self.hidden,
                      self.score_ids, self.score_k, self.keep_row, self.hidden_form, self.projection, self.ranks]}

    @classmethod
    def from_kwargs(cls, extra: dict[str, Any] | None) -> ScoreAsk:
        if not extra or KEY not in extra:
            raise ValueError("a scoring request needs PoolingParams.extra_kwargs['proctor'] (proctor's ask)")
        first_row, scores, topk, temperature, hidden, score_ids, score_k, keep_row, form, projection, ranks = extra[KEY]
        return cls(int(first_row), bool(scores), int(topk), float(temperature), bool(hidden),
                   bytes(score_ids), int(score_k), int(keep_row), str(form), str(projection), bool(ranks))

    def score_ids_tensor(self, rows: int) -> torch.Tensor | None:
        """The score ids as int32 [rows, score_k] (None when none were asked)."""
        if not self.score_k:
            return None
        ids = torch.frombuffer(bytearray(self.score_ids), dtype=torch.int32)
        if ids.numel() != rows * self.score_k:
            raise ValueError(f"score_ids hold {ids.numel()} ids, expected {rows} rows x {self.score_k}")
        return ids.reshape(rows, self.score_k)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


def pack(
    first_row: int,
    n: int,
    *,
    logprobs: torch.Tensor | None,
    ranks: torch.Tensor | None,
    topk_ids: torch.Tensor | None,
    topk_logprobs: torch.Tensor | None,
    score_logprobs: torch.Tensor | None,
    hidden: torch.Tensor | None,
    kept_logits: torch.Tensor | None,
    kept_hidden: torch.Tensor | None,
    positions: int,
    device: torch.device,
) -> torch.Tensor:
    """One request's answer as one uint8 tensor on `device` (module docstring)."""
    k = 0 if topk_ids is None else int(topk_ids.shape[1])
    ks = 0 if score_logprobs is None else int(score_logprobs.shape[1])
    h = 0 if hidden is None else int(hidden.shape[1])
    code = 0 if hidden is None else _DTYPES.index(hidden.dtype)
    v = 0 if kept_logits is None else int(kept_logits.numel())
    kept_h = 0 if kept_hidden is None else int(kept_hidden.numel())
    scores = int(logprobs is not None) | (2 if logprobs is not None and ranks is not None else 0)
    header = torch.tensor([MAGIC, VERSION, first_row, n, scores, k, ks, h, code, v, kept_h, positions],
                          dtype=torch.int64, device=device)
    sections = [header]
    if logprobs is not None:
        sections.append(logprobs.float())
    if scores & 2:
        sections.append(ranks.to(torch.int32))
    if k:
        sections += [topk_ids.to(torch.int32), topk_logprobs.float()]
    if ks:
        sections.append(score_logprobs.float())
    if h:
        sections.append(hidden)
    if v:
        sections.append(kept_logits.float().reshape(-1))
    if kept_h:
        sections.append(kept_hidden.float().reshape(-1))
    return torch.cat([_bytes(s.to(device)) for s in sections])


@dataclass
class PooledScores:
    """An unpacked answer: rows `first_row .. first_row + n - 1` (views of the answer's bytes)."""

    first_row: int
    n: int
    logprobs: torch.Tensor | None
    ranks: torch.Tensor | None
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    score_logprobs: torch.Tensor | None
    hidden: torch.Tensor | None
    kept_logits: torch.Tensor | None  # float32 [V]
    kept_hidden: torch.Tensor | None  # float32 [H]
    positions: int = 0  # positions the pooler saw for this request


def unpack(answer: Any) -> PooledScores:
    """The answer's sections as tensors viewing its bytes; a malformed answer raises ValueError."""
    raw = np.ascontiguousarray(np.asarray(answer.numpy() if isinstance(answer, torch.Tensor) else answer,
                                          dtype=np.uint8)).reshape(-1)
    if raw.size < _HEADER * 8:
        raise ValueError(f"a scoring answer of {raw.size} bytes has no header")
    magic, version, first_row, n, scores, k, ks, h, code, v, kept_h, positions = (
        int(x) for x in raw[: _HEADER * 8].view(np.int64))
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a proctor scoring answer (magic {magic:#x}, version {version})")
    offset = _HEADER * 8

    def take(dtype: torch.dtype, *shape: int) -> torch.Tensor:
        nonlocal offset
        size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        if offset + size > raw.size:
            raise ValueError("a scoring answer is shorter than its header says")
        part = torch.from_numpy(raw[offset : offset + size]).view(dtype).reshape(shape)
        offset += size
        return part

    lp = take(torch.float32, n) if scores & 1 else None
    ranks = take(torch.int32, n) if scores & 2 else None
    ids = take(torch.int32, n, k) if k else None
    vals = take(torch.float32, n, k) if k else None
    score = take(torch.float32, n, ks) if ks else None
    hidden = take(_DTYPES[code], n, h) if h else None
    kept_logits = take(torch.float32, v) if v else None
    kept_hidden = take(torch.float32, kept_h) if kept_h else None
    if offset != raw.size:
        raise ValueError(f"a scoring answer has {raw.size - offset} bytes beyond its sections")
    return PooledScores(first_row, n, lp, ranks, ids, vals, score, hidden, kept_logits, kept_hidden, positions)
