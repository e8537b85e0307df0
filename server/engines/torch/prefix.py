"""Shared prompts on the torch engine: a GRPO group's prompt is prefilled once, its KV cache kept.

A batch is split three ways (`TorchPrefix.plan`):
- requests reuse does not apply to, and the first request of a prompt that is not cached (its
  *leader*), go through the engine's ordinary right-padded pass; for leaders that pass keeps its
  KV cache, and the leader's prompt slice (`[1, kv_heads, P, head_dim]` per layer) plus its last
  prompt position's hidden state are stored in the `PromptCache`;
- every other request of a cached prompt (also one stored by this batch's own leader) is scored
  against that cache: the group's responses, right-padded, in one batched pass whose past is the
  prompt's KV expanded to the group's size. Row P (the first response token's, from position
  P-1) is the stored hidden state; rows P+1..T-1 come from the response positions.

Hidden states are what the lm_head consumes, so log-probs, top-k, score_ids, temperature and the
hidden-state output all follow from them unchanged (`TorchEngine._head_outputs`). Causal
attention makes a position's result depend only on the positions before it, so the cached
result equals an independent forward up to float rounding (tested at 1e-5 in float32).

Only models whose every attention layer is full attention are served this way (a sliding-window
layer keeps only its window, so its prompt state is not the prompt's KV); others are scored
whole, as with reuse off. Memory: a leader's pass keeps its batch's KV (`batch_cache`, the
tensors the attention computed, not a copy) until the prompt slices are copied out; an entry costs 2 * layers * kv_heads * head_dim * P values.

The path builds on transformers' cache internals (`Cache(layer_class_to_replicate=...)`,
`DynamicLayer.lazy_initialization(keys, values)`, `DynamicCache(ddp_cache_data=...)`), which
change between releases. So `reuse_works` runs it at replica start on a tiny input against the
plain pass: where it raises or differs, prompt reuse is off for that engine (one log line) and
every request is scored whole; a replica never fails for it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from proctor.proto.versions import installed
from proctor.server.engines.base import EngineRequest
from proctor.server.prompt_reuse import PromptCache, ReuseSettings, prompt_key

log = logging.getLogger(__name__)

# The engine's padded pass: (decoder body, requests, keep_cache) -> (rows per request, cache or None).
PaddedPass = Callable[[torch.nn.Module, list[EngineRequest], bool], tuple[list[torch.Tensor], object]]


@dataclass
class PromptState:
    """What a prompt leaves behind: its KV per layer and the hidden state at position P-1."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # each [1, kv_heads, P, head_dim]
    last_hidden: torch.Tensor  # [H]: row P's state

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.layers for t in pair] + [self.last_hidden]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class ReusePlan:
    """How one batch is scored: `plain` indices in the padded pass (of which `leaders` keep their
    prompt), `groups` key -> indices scored from a cached prompt."""

    plain: list[int] = field(default_factory=list)
    leaders: dict[int, bytes] = field(default_factory=dict)
    groups: dict[bytes, list[int]] = field(default_factory=dict)
    cached: dict[bytes, PromptState] = field(default_factory=dict)


def supports_prompt_cache(model: torch.nn.Module) -> bool:
    """Whether every layer of this model's cache is full attention (see the module docstring)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


class TorchPrefix:
    """The torch engine's prompt cache and the two passes around it."""

    def __init__(self, settings: ReuseSettings) -> None:
        self.settings = settings
        self.cache: PromptCache[PromptState] = PromptCache(settings.memory_bytes, settings.ttl_s)
        self.group_passes = 0  # batched passes against a cached prompt (observable in tests)

    def plan(self, batch: list[EngineRequest]) -> ReusePlan:
        plan = ReusePlan()
        keys: dict[bytes, bool] = {}  # key -> whether it has a leader in this batch
        for index, request in enumerate(batch):
            if not self.settings.applies(request):
                plan.plain.append(index)
                continue
            key = prompt_key(request)
            if key not in keys:
                state = self.cache.get(key, request.token_ids[: request.first_row])
                keys[key] = state is None
                if state is None:
                    plan.plain.append(index)
                    plan.leaders[index] = key
                    continue
                plan.cached[key] = state
            plan.groups.setdefault(key, []).append(index)
        return plan

    def states(
        self, body: torch.nn.Module, batch: list[EngineRequest], padded: PaddedPass
    ) -> tuple[list[torch.Tensor], list[int | None]]:
        """Each request's rows first_row..T-1 of last-layer hidden states, and the prompt tokens
        each one did not recompute (None where reuse does not apply)."""
        plan = self.plan(batch)
        states: list[torch.Tensor | None] = [None] * len(batch)
        reused: list[int | None] = [None] * len(batch)
        if plan.plain:
            rows, cache = padded(body, [batch[i] for i in plan.plain], bool(plan.leaders))
            for slot, index in enumerate(plan.plain):
                states[index] = rows[slot]
                if index in plan.leaders:
                    key, request = plan.leaders[index], batch[index]
                    reused[index] = 0
                    state = _prompt_state(cache, slot, request.first_row, rows[slot][0])
                    if state is None:  # not a plain KV cache after all: this model is scored whole
                        log.warning("prompt reuse off for this model: its KV cache is not full attention")
                        self.settings = replace(self.settings, enabled=False)
                        continue
                    plan.cached[key] = state  # this batch's followers use it even if the cap refuses it
                    self.cache.put(key, request.token_ids[: request.first_row], state, state.nbytes)
        for key in [k for k in plan.groups if k not in plan.cached]:  # their leader's state was unusable
            members = plan.groups.pop(key)
            rows, _ = padded(body, [batch[i] for i in members], False)
            for index, row in zip(members, rows, strict=True):
                states[index] = row
        for key, members in plan.groups.items():
            group = [batch[i] for i in members]
            for index, rows in zip(members, self._group_pass(body, plan.cached[key], group), strict=True):
                states[index] = rows
                reused[index] = batch[index].first_row
        return states, reused  # type: ignore[return-value]

    def _group_pass(self, body: torch.nn.Module, state: PromptState, group: list[EngineRequest]) -> list[torch.Tensor]:
        """The responses of one prompt's group in one right-padded pass against its cached KV."""
        from transformers.cache_utils import DynamicCache

        prompt_length = group[0].first_row
        fed = [r.num_tokens - 1 - prompt_length for r in group]  # positions P..T-2 produce rows P+1..T-1
        width = max(fed)
        first = state.last_hidden[None]
        if width == 0:  # one-token responses: row P is all there is
            return [first.clone() for _ in group]
        device = state.last_hidden.device
        count = len(group)
        ids = torch.zeros((count, width), dtype=torch.long)
        mask = torch.zeros((count, prompt_length + width), dtype=torch.long)
        mask[:, :prompt_length] = 1
        for row, (request, length) in enumerate(zip(group, fed, strict=True)):
            ids[row, :length] = request.token_ids[prompt_length : prompt_length + length]
            mask[row, prompt_length : prompt_length + length] = 1
        past = DynamicCache(
            ddp_cache_data=[(k.expand(count, -1, -1, -1), v.expand(count, -1, -1, -1)) for k, v in state.layers]
        )
        self.group_passes += 1
        hidden = body(
            input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=past, use_cache=True
        ).last_hidden_state
        return [torch.cat([first, hidden[row, :length]]) for row, length in enumerate(fed)]

    def clear(self) -> None:
        """Forget every prompt (the weights changed: a swap group copied another teacher in)."""
        self.cache.clear()


def batch_cache():
    """The cache a padded pass that keeps its prompts runs with: each layer holds the batch's keys
    and values as the attention got them (transformers' DynamicCache would copy them into a cache
    of its own, a few percent of the pass), until the leaders' prompt slices are copied out."""
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


def _prompt_state(cache, slot: int, prompt_length: int, last_hidden: torch.Tensor) -> PromptState | None:
    """One request's prompt slice of a padded batch's KV cache, copied out of the batch."""
    layers = []
    layer_list = getattr(cache, "layers", None)
    if not layer_list or any(not isinstance(layer, _kept_layer()) or layer.keys is None for layer in layer_list):
        return None
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        layers.append((keys[slot : slot + 1, :, :prompt_length].clone(), values[slot : slot + 1, :, :prompt_length].clone()))
    return PromptState(layers=layers, last_hidden=last_hidden.clone())


# The probe's tiny input: one prompt, a batch of a leader and a member (the leader's own state),
# then a member from the cache; how far the reuse path may be from the plain pass, relative to it.
_PROBE_PROMPT, _PROBE_RESPONSES = 6, ((4, 2), (3,))
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
_PROBE_HALF_TOLERANCE = 3e-2


def reuse_works(body: torch.nn.Module, padded: PaddedPass) -> bool:
    """Whether this transformers release's cache internals serve the reuse path: a tiny group
    scored through it (a leader, a member in its batch, a member from the cache) equals the plain
    padded pass. False (after one log line saying reuse is off) where it raises or differs."""
    try:
        with torch.inference_mode():
            gap = _probe_gap(body, padded)
    except Exception as exc:  # any failure of the internals is a reason to score whole, not to fail
        why = f"{type(exc).__name__}: {exc}"
    else:
        if gap is None:  # the path turned itself off and said so (not a full-attention KV cache)
            return False
        dtype = next(body.parameters()).dtype
        if gap <= _PROBE_TOLERANCE.get(dtype, _PROBE_HALF_TOLERANCE):
            return True
        why = f"its rows differ from the plain pass by {gap:.3g} (relative)"
    log.warning("prompt reuse off for this teacher: the shared-prompt path does not work with transformers %s "
                "(%s); every request is scored whole", installed("transformers"), why)
    return False


def _probe_gap(body: torch.nn.Module, padded: PaddedPass) -> float | None:
    """The largest relative difference between the reuse path's rows and the plain pass's over the
    probe's requests; None when the reuse path turned itself off."""
    vocab = int(getattr(body.config, "vocab_size", 0) or 16)
    width = _PROBE_PROMPT + max(max(batch) for batch in _PROBE_RESPONSES)
    ids = (torch.arange(width * len(_PROBE_RESPONSES) * 2) * 7 + 3).remainder(vocab)
    prompt, offset = ids[:_PROBE_PROMPT], _PROBE_PROMPT
    prefix = TorchPrefix(ReuseSettings(enabled=True, min_tokens=1))
    worst = 0.0
    for step, lengths in enumerate(_PROBE_RESPONSES):
        batch = []
        for index, length in enumerate(lengths):
            response = ids[offset : offset + length]
            offset += length
            batch.append(EngineRequest(request_id=f"probe{step}.{index}", token_ids=torch.cat([prompt, response]),
                                       first_row=_PROBE_PROMPT, logprobs=True, topk=0, hidden_states=False))
        states, reused = prefix.states(body, batch, padded)
        if not prefix.settings.enabled:
            return None
        expected = [0, *[_PROBE_PROMPT] * (len(batch) - 1)] if step == 0 else [_PROBE_PROMPT] * len(batch)
        if reused != expected:
            raise RuntimeError(f"the reuse path reused {reused} prompt tokens, expected {expected}")
        plain, _ = padded(body, batch, False)
        for ours, theirs in zip(states, plain, strict=True):
            if ours.shape != theirs.shape:
                raise RuntimeError(f"rows of shape {tuple(ours.shape)}, the plain pass's {tuple(theirs.shape)}")
            scale = float(theirs.float().norm()) or 1.0
            worst = max(worst, float((ours.float() - theirs.float()).norm()) / scale)
    return worst
