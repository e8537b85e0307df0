"""The rows a scored sequence leaves behind, and which of them a request sharing its prefix may copy.

Row i is about token i given tokens 0..i-1 (the wire's row convention), so it depends on tokens
0..i only: a request whose first `shared` tokens equal a scored sequence's has the same rows
1..shared-1 as that sequence, in every output (log-prob and rank of the same token, the same
top-k, the same hidden state, the same log-probs at the same ids). A `RowRecord` keeps a scored
sequence's answer as its request asked it; `copyable_end` says how far a later request's rows can
be copied from it, checking everything that makes a row differ: the rows the record holds, the
outputs and top-k width it holds, the temperature, and the score_ids row by row. Whatever is not
copyable is computed; nothing is guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from proctor.server.engines.base import EngineRequest, EngineResult


@dataclass
class RowRecord:
    """A scored sequence's rows `first_row..num_tokens-1` as its request asked them; `result` is
    set once it is scored (until then a record says what it will hold)."""

    first_row: int
    num_tokens: int
    temperature: float
    logprobs: bool
    topk: int
    hidden: bool
    score_ids: np.ndarray | None  # int32 [rows, K], -1 padding
    result: EngineResult | None = None
    hidden_form: str = ""  # the form its hidden rows are in: only a request asking the same copies them
    ranks: bool = False

    @classmethod
    def asked_by(cls, request: EngineRequest) -> RowRecord:
        return cls(request.first_row, request.num_tokens, request.temperature, request.logprobs, request.topk,
                   request.hidden_states, None if request.score_ids is None else request.score_ids.copy(),
                   hidden_form=request.hidden_form, ranks=request.ranks)  # a copy: a record outlives its request's frame

    @property
    def nbytes(self) -> int:
        if self.result is None:
            return 0
        tensors = (self.result.logprobs, self.result.ranks, self.result.topk_ids, self.result.topk_logprobs,
                   self.result.score_logprobs, self.result.hidden_states)
        held = 0 if self.score_ids is None else self.score_ids.nbytes
        return held + sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def copyable_end(self, request: EngineRequest, shared: int) -> int:
        """The last row r such that rows `request.first_row..r` can be copied from this record for
        `request`, whose first `shared` tokens equal the record's; `request.first_row - 1` when none."""
        first = request.first_row
        none = first - 1
        end = min(shared - 1, self.num_tokens - 1)
        if first < self.first_row or end < first:
            return none
        if (request.logprobs and not self.logprobs) or (request.logprobs and request.ranks and not self.ranks) \
                or request.topk > self.topk \
                or (request.hidden_states and (not self.hidden or request.hidden_form != self.hidden_form)):
            return none
        scores = request.logprobs or request.topk or request.score_ids is not None
        if scores and request.temperature != self.temperature:
            return none
        if request.score_ids is not None:
            width = request.score_ids.shape[1]
            if self.score_ids is None or width > self.score_ids.shape[1]:
                return none
            kept = self.score_ids[first - self.first_row : end - self.first_row + 1, :width]
            differ = np.flatnonzero((kept != request.score_ids[: end - first + 1]).any(axis=1))
            if differ.size:
                end = first + int(differ[0]) - 1
        return end

    def rows(self, request: EngineRequest, end: int) -> EngineResult:
        """Rows `request.first_row..end` of what `request` asks, copied from this scored record."""
        if self.result is None:
            raise RuntimeError("a record's rows were read before it was scored")
        kept = self.result
        lo, hi = request.first_row - self.first_row, end - self.first_row + 1
        out = EngineResult(first_row=request.first_row)
        if request.logprobs:
            out.logprobs = kept.logprobs[lo:hi]
            if request.ranks:
                out.ranks = kept.ranks[lo:hi]
        if request.topk:
            out.topk_ids = kept.topk_ids[lo:hi, : request.topk]
            out.topk_logprobs = kept.topk_logprobs[lo:hi, : request.topk]
        if request.score_ids is not None:
            out.score_logprobs = kept.score_logprobs[lo:hi, : request.score_ids.shape[1]]
        if request.hidden_states:
            out.hidden_states = kept.hidden_states[lo:hi]
        return out


_ROW_FIELDS = ("logprobs", "ranks", "topk_ids", "topk_logprobs", "score_logprobs", "hidden_states")


def joined(request: EngineRequest, parts: list[EngineResult]) -> EngineResult:
    """One result for rows `request.first_row..T-1` from consecutive parts (copied rows, computed
    rows), each part's `first_row` where the one before it ends; the last part's other fields."""
    expected = request.first_row
    for part in parts:
        if part.first_row != expected:
            raise RuntimeError(f"row parts do not join: a part starts at row {part.first_row}, expected {expected}")
        expected += _rows(part)
    if expected != request.num_tokens:
        raise RuntimeError(f"row parts end at row {expected - 1}, expected {request.num_tokens - 1}")
    out = EngineResult(first_row=request.first_row, prompt_reused_tokens=parts[-1].prompt_reused_tokens,
                       computed_tokens=parts[-1].computed_tokens)
    for name in _ROW_FIELDS:
        values = [getattr(part, name) for part in parts]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            raise RuntimeError(f"row parts disagree on whether {name} was asked")
        setattr(out, name, values[0] if len(values) == 1 else torch.cat(values))
    return out


def _rows(part: EngineResult) -> int:
    for name in _ROW_FIELDS:
        value = getattr(part, name)
        if value is not None:
            return int(value.shape[0])
    raise RuntimeError("a row part holds no rows")
