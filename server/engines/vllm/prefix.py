"""Shared prefixes on the vLLM engine: vLLM's prefix cache read only where no stale row can come out.

vLLM's pooling runner, asked to read its prefix cache (`skip_reading_prefix_cache=False`),
computes only the positions after the c cached ones: the scoring pooler sees positions c..T-1, so
it can answer rows c+1.. only (row i from position i-1), and its answer says which rows it computed
(`PooledScores.first_row`, from the positions it actually saw, not from a count vLLM reports) and
how many positions it ran. The lane keeps a record of every sequence it scored (`PrefixStore`,
found by block hashes with the shared count exact; its rows as asked, `RowRecord`), and a request
that shares at least `min_tokens` leading tokens with a record (its *source*) is a follower:
- it reads the cache only if the source can give every row a hit could take from it
  (`RowRecord.copyable_end` reaches the shared count, or no wanted row lies inside it); otherwise it
  is scored whole, as a leader;
- its answer's first computed row a decides (`take`): a <= first_row: `WHOLE`; the rows
  first_row..a-1 are copyable from the source: `COPY`; a-1 is the shared count M (the hit covers the
  whole shared prefix, whose last row the source cannot give, since its token M differs): rows up to
  M-1 copied and row M from the raw logits and hidden state at position M-1, which a request of the
  prefix alone computes (vLLM always computes a request's last token; shared by the group, and
  kept by a leader with a prompt length for row P): `ROW`; anything else (vLLM's hit went past
  what the source shares): score again with the cache off: `RESCORE`.
The record buys order: a request with no finished source waits for a matching request in flight
(its leader) and then finds its blocks cached instead of computing the prefix beside it. A
cancelled or failed leader's record is dropped, releasing its followers, which then lead.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from proctor.server.engines.base import EngineRequest, EngineResult
from proctor.server.engines.prefix_rows import RowRecord, joined
from proctor.server.engines.prompt_reuse import Match, PrefixStore, ReuseSettings
from proctor.server.engines.token_ids import token_array
from proctor.server.engines.vllm.pooled_scores import PooledScores

log = logging.getLogger(__name__)


class Take(enum.Enum):
    WHOLE = "whole"  # every row the request needs was computed
    COPY = "copy"  # the rows inside the hit copied from the source
    ROW = "row"  # as COPY up to the shared count M, row M from position M-1's kept logits
    RESCORE = "rescore"  # a needed row was neither computed nor available: score again uncached


def covers(copy_end: int, shared: int, first_row: int) -> bool:
    """Whether a source that shares `shared` tokens and can give rows up to `copy_end` gives every
    wanted row inside the shared prefix but its last (row `shared`, computed from the prefix alone)."""
    return copy_end >= shared - 1 or shared - 1 < first_row


def take(first_computed: int, first_row: int, copy_end: int, shared: int) -> Take:
    """How an answer whose first computed row is `first_computed` may be used for a request that
    wants rows from `first_row`, whose source can give rows up to `copy_end` and shares `shared` tokens."""
    if first_computed <= first_row:
        return Take.WHOLE
    last_missing = first_computed - 1
    if last_missing <= copy_end:
        return Take.COPY
    if last_missing == shared and covers(copy_end, shared, first_row):
        return Take.ROW
    return Take.RESCORE


@dataclass(frozen=True)
class KeptRow:
    """Row M of a prefix: the raw logits [V] and the hidden state [H] at position M-1."""

    logits: torch.Tensor
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * 4 + self.hidden.numel() * 4


class Scorer(Protocol):
    """What the lane asks of the engine."""

    async def encode(self, request: EngineRequest, *, read_cache: bool, keep_row: int = 0) -> PooledScores: ...

    async def prefix_row(self, request: EngineRequest, length: int) -> tuple[KeptRow, int]: ...

    def computed_rows(self, request: EngineRequest, pooled: PooledScores) -> EngineResult: ...

    def kept_row(self, request: EngineRequest, row: KeptRow, index: int) -> EngineResult: ...


@dataclass
class _Record:
    """One scored (or in flight) sequence: its rows, and kept rows by index once known."""

    rows: RowRecord
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    kept: dict[int, KeptRow] = field(default_factory=dict)
    pending: dict[int, asyncio.Task] = field(default_factory=dict)  # prefix-alone computations, shared

    @property
    def nbytes(self) -> int:
        return 256 + self.rows.nbytes + sum(row.nbytes for row in self.kept.values())


def kept_row(pooled: PooledScores) -> KeptRow | None:
    if pooled.kept_logits is None or pooled.kept_hidden is None:
        return None
    return KeptRow(pooled.kept_logits.clone(), pooled.kept_hidden.clone())


class PrefixLane:
    """The records of the sequences one vLLM engine scored, and the reuse of its prefix cache."""

    def __init__(self, settings: ReuseSettings) -> None:
        self.settings = settings
        self.records: PrefixStore[_Record] = PrefixStore.of(settings)
        self.rescored = 0  # answers thrown away because a needed row was not computed

    async def run(self, request: EngineRequest, engine: Scorer) -> EngineResult:
        """Score `request` through the cache (module docstring)."""
        tokens = token_array(request.token_ids)
        hashes = self.records.hashes(tokens, request.cache_salt)
        source = await self._source(request, tokens, hashes)
        if source is not None:
            return await self._follow(request, *source, engine)
        return await self._lead(request, tokens, hashes, engine)

    async def _source(self, request: EngineRequest, tokens: np.ndarray,
                      hashes: list[bytes]) -> tuple[Match[_Record], int] | None:
        """A finished record the request can follow and how far its rows can be copied, after
        waiting for matching requests in flight (their prefixes are in vLLM's cache then)."""
        while True:
            found = self.records.candidates(tokens, hashes, at_least=self.settings.min_tokens)
            for match in found:
                if match.value.done.done() and match.value.rows.result is not None:
                    copy_end = match.value.rows.copyable_end(request, match.shared)
                    if covers(copy_end, match.shared, request.first_row):
                        return match, copy_end
            waiting = [match.value.done for match in found if not match.value.done.done()]
            if not waiting:
                return None
            await asyncio.shield(waiting[0])

    async def _lead(self, request: EngineRequest, tokens: np.ndarray, hashes: list[bytes],
                    engine: Scorer) -> EngineResult:
        record = _Record(RowRecord.asked_by(request))
        record_id = self.records.put(tokens, record, record.nbytes, hashes)
        try:
            keep = request.first_row if request.first_row > 1 else 0  # row P, where a group's responses part
            answer = await engine.encode(request, read_cache=False, keep_row=keep)
            result = engine.computed_rows(request, answer)
            if (row := kept_row(answer)) is not None:
                record.kept[keep] = row
            record.rows.result = result
            if record_id is not None:
                self.records.resize(record_id, record.nbytes)
        except BaseException:
            if record_id is not None:
                self.records.discard(record_id)
            raise
        finally:
            if not record.done.done():
                record.done.set_result(None)
        result.prompt_reused_tokens, result.computed_tokens = 0, answer.positions
        return result

    async def _follow(self, request: EngineRequest, found: Match[_Record], copy_end: int,
                      engine: Scorer) -> EngineResult:
        source, shared = found.value, found.shared
        answer = await engine.encode(request, read_cache=True)
        computed = answer.positions
        first = answer.first_row
        how = take(first, request.first_row, copy_end, shared)
        parts: list[EngineResult] = []
        if how in (Take.COPY, Take.ROW):
            last_copied = first - 1 if how is Take.COPY else shared - 1
            if last_copied >= request.first_row:
                parts.append(source.rows.rows(request, last_copied))
            if how is Take.ROW:
                row, extra = await self._row(found.record_id, source, shared, request, engine)
                if row is None:
                    how = Take.RESCORE
                else:
                    parts.append(engine.kept_row(request, row, shared))
                    computed += extra
        if how is Take.RESCORE:
            self.rescored += 1
            log.debug("request %s: its answer starts at row %d, its source shares %d tokens; scored again uncached",
                      request.request_id, first, shared)
            again = await engine.encode(request, read_cache=False)
            result = engine.computed_rows(request, again)
            result.prompt_reused_tokens, result.computed_tokens = 0, computed + again.positions
            return result
        parts.append(engine.computed_rows(request, answer))
        result = joined(request, parts) if len(parts) > 1 else parts[0]
        result.prompt_reused_tokens = request.num_tokens - answer.positions
        result.computed_tokens = computed
        return result

    async def _row(self, record_id: int, source: _Record, index: int, request: EngineRequest,
                   engine: Scorer) -> tuple[KeptRow | None, int]:
        """Row `index` of the source's prefix (kept, or computed once for the group); the positions
        this request's call computed for it (0 when another computed it)."""
        if index in source.kept:
            return source.kept[index], 0
        mine = index not in source.pending
        if mine:
            source.pending[index] = _started(engine.prefix_row(request, index))
        try:
            row, positions = await asyncio.shield(source.pending[index])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the request is then scored again uncached, never wrongly
            log.warning("computing a shared prefix's row %d failed: %s", index, exc)
            source.pending.pop(index, None)
            return None, 0
        if index not in source.kept:
            source.kept[index] = row
            self.records.resize(record_id, source.nbytes)
        return row, positions if mine else 0

    def clear(self) -> None:
        self.records.clear()


def _started(work) -> asyncio.Task:
    """A row computation shared by a group; its failure is read (and handled) by whoever awaits it."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
