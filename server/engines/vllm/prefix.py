"""Shared prompts on the vLLM engine: vLLM's prefix cache read only where no stale row can come out.

vLLM's pooling runner, asked to read its prefix cache (`skip_reading_prefix_cache=False`),
computes only the positions after the cached ones: with c cached tokens the scoring pooler sees
positions c..T-1, so rows c+1..T (row i from position i-1), and its answer says which rows it
computed (`PooledScores.first_row`, from the positions it actually saw, not from a count vLLM
reports). The rule reads that first row and nothing else (`decide`), so it holds whatever the
order of arrival, an eviction, a preemption or a resumed request did:
- first row = P (c < P): every row the request needs (P..T-1) was computed: `WHOLE`;
- first row = P + 1 (c = P, a prompt that fills whole blocks): rows P+1.. were computed; row P
  (the last prompt position's distribution) comes from the group's record of it, the raw logits
  and hidden state at position P-1 that the group's first answer kept (`ScoreAsk.keep_row`) or a
  request of the prompt alone computed (vLLM always computes a request's last token): `FIRST_ROW`;
- anything else (the hit reached into the response): score again with the cache off: `RESCORE`.

The record buys order: the first request of a prompt (its leader) goes alone and asks the pooler
to keep row P; the others of its group wait for it, so that they find its blocks cached instead
of computing the prompt beside it. A cancelled or failed leader releases its followers.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from proctor.server.engines.base import EngineRequest
from proctor.server.engines.vllm.pooled_scores import PooledScores
from proctor.server.prompt_reuse import PromptCache, ReuseSettings, prompt_key

log = logging.getLogger(__name__)


class Decision(enum.Enum):
    WHOLE = "whole"  # every row the request needs was computed
    FIRST_ROW = "first_row"  # all but row P; row P from the group's record
    RESCORE = "rescore"  # a needed row was not computed: score again without the cache


def decide(answer_first_row: int, prompt_length: int) -> Decision:
    """What an answer whose first computed row is `answer_first_row` may be used for."""
    if answer_first_row == prompt_length:
        return Decision.WHOLE
    return Decision.FIRST_ROW if answer_first_row == prompt_length + 1 else Decision.RESCORE


@dataclass(frozen=True)
class KeptRow:
    """Row P of a prompt: the raw logits [V] and the hidden state [H] at position P-1."""

    logits: torch.Tensor
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * 4 + self.hidden.numel() * 4


@dataclass
class _Record:
    """One prompt's state: the leader's progress and row P once known."""

    computed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    row: KeptRow | None = None
    pending: asyncio.Task | None = None  # a prompt-alone computation of row P, shared by the group

    @property
    def nbytes(self) -> int:
        return 256 + (self.row.nbytes if self.row is not None else 0)


@dataclass
class PoolerAnswer:
    """vLLM's answer for one request, unpacked, and the prompt tokens it reports cached."""

    pooled: PooledScores
    num_cached: int


# send(read_cache, keep_row) -> the request's answer; keep_row asks the pooler to keep row P.
Send = Callable[[bool, bool], Awaitable[PoolerAnswer]]


@dataclass
class Answer:
    """A lane's result: the answer, how to read it, row P when it came from the record."""

    scored: PoolerAnswer
    decision: Decision  # WHOLE or FIRST_ROW (a RESCORE was resolved by scoring again)
    row: KeptRow | None
    reused_tokens: int


def kept_row(pooled: PooledScores) -> KeptRow | None:
    if pooled.kept_logits is None or pooled.kept_hidden is None:
        return None
    return KeptRow(pooled.kept_logits.clone(), pooled.kept_hidden.clone())


class PrefixLane:
    """The records of shared prompts in one vLLM engine's prefix cache."""

    def __init__(self, settings: ReuseSettings) -> None:
        self.settings = settings
        self.records: PromptCache[_Record] = PromptCache(settings.memory_bytes, settings.ttl_s)
        self.rescored = 0  # answers thrown away because a needed row was not computed

    async def run(self, request: EngineRequest, send: Send,
                  prompt_row: Callable[[], Awaitable[KeptRow]]) -> Answer:
        """Score `request` through the cache; `prompt_row()` computes row P from the prompt alone."""
        key, prompt = prompt_key(request), request.token_ids[: request.first_row]
        record = self.records.get(key, prompt)
        leader = record is None
        if leader:
            record = _Record()
            self.records.put(key, prompt, record, record.nbytes)
        else:
            await asyncio.shield(record.computed)  # the leader's prompt is in vLLM's cache then
        try:
            scored = await send(True, record.row is None)
            if record.row is None and (row := kept_row(scored.pooled)) is not None:
                self._keep(key, prompt, record, row)
        finally:
            if leader and not record.computed.done():
                record.computed.set_result(None)
        decision = decide(scored.pooled.first_row, request.first_row)
        reused = max(0, scored.num_cached)
        if decision is Decision.WHOLE:
            return Answer(scored, decision, None, reused)
        if decision is Decision.FIRST_ROW:
            row = record.row or await self._prompt_row(key, prompt, record, prompt_row)
            if row is not None:
                return Answer(scored, decision, row, reused)
        self.rescored += 1
        log.debug("request %s: its answer starts at row %d for a %d-token prompt; scored again uncached",
                  request.request_id, scored.pooled.first_row, request.first_row)
        return Answer(await send(False, False), Decision.WHOLE, None, 0)

    def _keep(self, key: bytes, prompt: torch.Tensor, record: _Record, row: KeptRow) -> None:
        record.row = row
        self.records.put(key, prompt, record, record.nbytes)  # its size grew by the row

    async def _prompt_row(self, key: bytes, prompt: torch.Tensor, record: _Record,
                          compute: Callable[[], Awaitable[KeptRow]]) -> KeptRow | None:
        if record.pending is None:
            record.pending = _started(compute())
        try:
            row = await asyncio.shield(record.pending)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the group then scores without it (uncached), never wrongly
            log.warning("computing a shared prompt's first response row failed: %s", exc)
            record.pending = None
            return None
        if record.row is None:
            self._keep(key, prompt, record, row)
        return row

    def clear(self) -> None:
        self.records.clear()


def _started(work: Awaitable[KeptRow]) -> asyncio.Task:
    """A row computation shared by a group; its failure is read (and handled) by whoever awaits it."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
