"""Shared prefixes on the torch engine: a prefix the engine has computed is not computed again.

Every text request reuse applies to (`ReuseSettings.applies`) is either a *leader* or a
*follower* (`TorchPrefix.plan`):
- a follower shares at least `min_tokens` leading tokens with a sequence the engine holds a record
  of (`PrefixStore`, found by block hashes, the shared count exact) or with a leader of its own
  batch. No prompt length is needed to find it: a GRPO group's members share their prompt whether
  or not the client says where it ends;
- every other request goes through the engine's ordinary right-padded pass; a leader's pass keeps
  its KV cache, and after scoring its record (the sequence's KV, `[1, kv_heads, T, head_dim]` per
  layer, and its answer rows, `RowRecord`) is stored.

A follower's rows that its source holds in the outputs it asks (`RowRecord.copyable_end`: rows
before the shared count, same outputs, temperature and score_ids) are copied; the rest are computed
in one right-padded pass per source, whose past is the source's KV for the first `past` tokens,
expanded to the group's size: positions past..T-2 give rows past+1..T-1. `past` is the last copied
row, or with nothing to copy the row before the first wanted one (both within the shared tokens),
the smallest over the group. Causal attention makes a position's result depend only on the
positions before it, so this equals an independent forward up to float rounding (tested at 1e-5 in
float32); the copied rows are the source's own.

Only models whose every attention layer is full attention are served this way (a sliding-window
layer keeps only its window, so its state is not the prefix's KV); others are scored whole, as
with reuse off. Memory: a leader's pass keeps its batch's KV (`batch_cache`, the tensors the
attention computed, not a copy) until the leaders' slices are copied out; a record costs
2 * layers * kv_heads * head_dim * T values plus its rows.

The path builds on transformers' cache internals (`Cache(layer_class_to_replicate=...)`,
`DynamicLayer.lazy_initialization(keys, values)`, `DynamicCache(ddp_cache_data=...)`), which
change between releases, so the engine runs it at replica start on a tiny input against the
plain pass first (`torch.reuse_probe`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from proctor.server.engines.base import EngineRequest, EngineResult
from proctor.server.engines.prefix_rows import RowRecord, joined
from proctor.server.engines.prompt_reuse import PrefixStore, ReuseSettings, common_prefix
from proctor.server.engines.token_ids import index_tensor, token_array

log = logging.getLogger(__name__)

# The engine's padded pass: (decoder body, requests, keep_cache) -> (rows per request, cache or None).
PaddedPass = Callable[[torch.nn.Module, list[EngineRequest], bool], tuple[list[torch.Tensor], object]]


@dataclass
class SequenceState:
    """What a scored sequence leaves behind: its KV per layer over all its positions, and its rows."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # each [1, kv_heads, T, head_dim]
    rows: RowRecord

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair) + self.rows.nbytes


@dataclass
class Follower:
    """A request scored from a source's prefix: positions from `past` on computed against the
    source's KV, its rows up to `past` (from its first row) copied."""

    index: int
    source: object  # the stored SequenceState, or the batch index (int) of a leader in this batch
    past: int


@dataclass
class ReusePlan:
    """How one batch is scored: `plain` indices in the padded pass (of which `leaders` keep their
    KV), `followers` from a source's prefix."""

    plain: list[int] = field(default_factory=list)
    leaders: list[int] = field(default_factory=list)
    followers: list[Follower] = field(default_factory=list)
    states: dict[int, SequenceState] = field(default_factory=dict)  # leaders of this batch, once known
    hashes: dict[int, list[bytes]] = field(default_factory=dict)


@dataclass
class PrefixPass:
    """A batch's forward through the reuse path: each request's hidden-state rows for the rows it
    computed, and the request as computed (`views`: a follower's rows start after its copied ones)."""

    plan: ReusePlan
    batch: list[EngineRequest]
    states: list[torch.Tensor]
    views: list[EngineRequest]


def supports_prompt_cache(model: torch.nn.Module) -> bool:
    """Whether every layer of this model's cache is full attention (see the module docstring)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


def _source_rows(source: object, plan: ReusePlan, batch: list[EngineRequest]) -> RowRecord:
    if isinstance(source, SequenceState):
        return source.rows
    state = plan.states.get(source)  # type: ignore[arg-type]
    return state.rows if state is not None else RowRecord.asked_by(batch[source])  # type: ignore[index]


class TorchPrefix:
    """The torch engine's prefix records and the passes around them."""

    def __init__(self, settings: ReuseSettings) -> None:
        self.settings = settings
        self.cache: PrefixStore[SequenceState] = PrefixStore.of(settings)
        self.group_passes = 0  # batched passes against a source's prefix (observable in tests)

    def plan(self, batch: list[EngineRequest]) -> ReusePlan:
        plan = ReusePlan()
        tokens = [token_array(r.token_ids) for r in batch]
        for index, request in enumerate(batch):
            if not self.settings.applies(request):
                plan.plain.append(index)
                continue
            plan.hashes[index] = self.cache.hashes(tokens[index], request.cache_salt)
            follower = self._follower(plan, batch, tokens, index)
            if follower is None:
                plan.plain.append(index)
                plan.leaders.append(index)
            else:
                plan.followers.append(follower)
        return plan

    def _follower(self, plan: ReusePlan, batch: list[EngineRequest], tokens: list, index: int) -> Follower | None:
        """The request's best source (a stored record or a leader of this batch), or None."""
        request, least = batch[index], self.settings.min_tokens
        sources: list[tuple[int, object]] = [
            (found.shared, found.value)
            for found in self.cache.candidates(tokens[index], plan.hashes[index], at_least=least)]
        for leader in plan.leaders:
            if batch[leader].cache_salt != request.cache_salt:  # another scope's prompt: never a source
                continue
            shared = common_prefix(tokens[leader], tokens[index])
            if shared >= least:
                sources.append((shared, leader))
        best: Follower | None = None
        for shared, source in sources:
            copy_end = _source_rows(source, plan, batch).copyable_end(request, shared)
            past = copy_end if copy_end >= request.first_row else min(request.first_row - 1, shared)
            # the last shared position is recomputed when the rows before it are copied: hence least - 1
            if past >= least - 1 and past > 0 and (best is None or past > best.past):
                best = Follower(index, source, past)
        return best

    def states(self, body: torch.nn.Module, batch: list[EngineRequest], padded: PaddedPass) -> PrefixPass:
        """Each request's hidden-state rows for the rows the engine computes for it."""
        plan = self.plan(batch)
        states: list[torch.Tensor | None] = [None] * len(batch)
        views = list(batch)
        if plan.plain:
            rows, cache = padded(body, [batch[i] for i in plan.plain], bool(plan.leaders))
            for slot, index in enumerate(plan.plain):
                states[index] = rows[slot]
                if index in plan.leaders:
                    state = _sequence_state(cache, slot, batch[index])
                    if state is None:  # not a plain KV cache after all: this model is scored whole
                        log.warning("prompt reuse off for this model: its KV cache is not full attention")
                        self.settings = replace(self.settings, enabled=False)
                        continue
                    plan.states[index] = state
        orphans = [f for f in plan.followers if isinstance(f.source, int) and f.source not in plan.states]
        if orphans:  # their leader's state was unusable: scored whole
            rows, _ = padded(body, [batch[f.index] for f in orphans], False)
            for follower, row in zip(orphans, rows, strict=True):
                states[follower.index] = row
            plan.followers = [f for f in plan.followers if f not in orphans]
        for members in _by_source(plan.followers):
            past = min(f.past for f in members)
            source = members[0].source
            layers = source.layers if isinstance(source, SequenceState) else plan.states[source].layers
            computed = self._group_pass(body, layers, past, [batch[f.index] for f in members])
            for follower, rows in zip(members, computed, strict=True):
                follower.past = past
                request = batch[follower.index]
                start = max(request.first_row, past + 1)
                states[follower.index] = rows[start - past - 1 :]
                views[follower.index] = _computed_part(request, start)
        return PrefixPass(plan, batch, states, views)  # type: ignore[arg-type]

    def finish(self, scored: PrefixPass, results: list[EngineResult]) -> list[EngineResult]:
        """Each request's whole result: a follower's copied rows joined to its computed ones; each
        leader's record stored. `results` hold the rows of `scored.views`."""
        plan, batch = scored.plan, scored.batch
        applied = set(plan.hashes)
        for index, result in enumerate(results):
            result.computed_tokens = batch[index].num_tokens
            result.prompt_reused_tokens = 0 if index in applied else None
        for index, state in plan.states.items():
            state.rows.result = results[index]
            self.cache.put(batch[index].token_ids, state, state.nbytes, plan.hashes[index])
        for follower in plan.followers:
            request, computed = batch[follower.index], results[follower.index]
            computed.prompt_reused_tokens = follower.past
            computed.computed_tokens = request.num_tokens - 1 - follower.past
            parts = [computed]
            if follower.past >= request.first_row:
                parts.insert(0, _source_rows(follower.source, plan, batch).rows(request, follower.past))
            results[follower.index] = joined(request, parts)
        return results

    def _group_pass(self, body: torch.nn.Module, layers: list[tuple[torch.Tensor, torch.Tensor]], past: int,
                    group: list[EngineRequest]) -> list[torch.Tensor]:
        """Rows past+1..T-1 of every member in one right-padded pass against the source's KV of its
        first `past` tokens."""
        from transformers.cache_utils import DynamicCache

        fed = [r.num_tokens - 1 - past for r in group]  # positions past..T-2 produce rows past+1..T-1
        width = max(fed)
        device = layers[0][0].device
        if width == 0:  # every row was copied
            hidden = layers[0][0].new_zeros((len(group), 0, body.config.hidden_size))
            return [hidden[row] for row in range(len(group))]
        count = len(group)
        ids = torch.zeros((count, width), dtype=torch.long)
        mask = torch.zeros((count, past + width), dtype=torch.long)
        mask[:, :past] = 1
        for row, (request, length) in enumerate(zip(group, fed, strict=True)):
            ids[row, :length] = index_tensor(request.token_ids[past : past + length])
            mask[row, past : past + length] = 1
        kv = DynamicCache(ddp_cache_data=[(k[:, :, :past].expand(count, -1, -1, -1),
                                           v[:, :, :past].expand(count, -1, -1, -1)) for k, v in layers])
        self.group_passes += 1
        hidden = body(input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=kv,
                      use_cache=True).last_hidden_state
        return [hidden[row, :length] for row, length in enumerate(fed)]

    def clear(self) -> None:
        """Forget every record (the weights changed: a swap group copied another teacher in)."""
        self.cache.clear()


def _by_source(followers: list[Follower]) -> list[list[Follower]]:
    groups: dict[int, list[Follower]] = {}
    for follower in followers:
        groups.setdefault(id(follower.source) if isinstance(follower.source, SequenceState)
                          else -1 - follower.source, []).append(follower)  # type: ignore[operator]
    return list(groups.values())


def _computed_part(request: EngineRequest, start: int) -> EngineRequest:
    """The request as the forward computes it: rows start..T-1 (its score_ids rows with them)."""
    if start == request.first_row:
        return request
    score_ids = request.score_ids[start - request.first_row :] if request.score_ids is not None else None
    return replace(request, first_row=start, score_ids=score_ids)


def batch_cache():
    """The cache a padded pass that keeps its prompts runs with: each layer holds the batch's keys
    and values as the attention got them (transformers' DynamicCache would copy them into a cache
    of its own, a few percent of the pass), until the leaders' slices are copied out."""
    from transformers.cache_utils import Cache

    return Cache(layer_class_to_replicate=_kept_layer())


@functools.cache
def _kept_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    class KeptLayer(DynamicLayer):
        """A cache layer that keeps the keys and values of one pass as they are (no copy)."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return key_states, value_states

    return KeptLayer


def _sequence_state(cache, slot: int, request: EngineRequest) -> SequenceState | None:
    """One request's slice of a padded batch's KV cache, copied out of the batch."""
    layer_list = getattr(cache, "layers", None)
    if not layer_list or any(not isinstance(layer, _kept_layer()) or layer.keys is None for layer in layer_list):
        return None
    length = request.num_tokens
    layers = [(layer.keys[slot : slot + 1, :, :length].clone(), layer.values[slot : slot + 1, :, :length].clone())
              for layer in layer_list]
    return SequenceState(layers=layers, rows=RowRecord.asked_by(request))
