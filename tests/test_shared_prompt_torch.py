"""Shared-prompt scoring on the torch engine: a group's prompt is prefilled once and kept, every
member still equals an independent uncached forward (float32, 1e-5; top-k ids equal).

The traffic is GRPO-shaped (`support.groups`): interleaved groups, members in shuffled order and in
several batches (as rollouts finish), one-token responses, a member whose response starts like
another's, hidden states, score_ids and temperature on the cached path.
"""

from __future__ import annotations

import logging

import pytest
import torch

from proctor.server.engines.base import EngineSpec
from proctor.server.engines.factory import create_engine
from proctor.server.engines.torch.prefix import TorchPrefix, reuse_works
from proctor.server.prompt_reuse import PromptCache, ReuseSettingError, ReuseSettings

from support.groups import assert_exact, interleaved, make_groups, request_of

REUSE = {"prompt_reuse_min_tokens": 16}


async def _engine(model_dir, **inference):
    engine = create_engine(EngineSpec(name="torch", model_path=str(model_dir), dtype="float32", max_topk=16,
                                      inference={**REUSE, **inference}))
    await engine.start()
    return engine


@pytest.fixture(scope="module")
async def engine(tiny_model_dir):
    engine = await _engine(tiny_model_dir)
    yield engine
    await engine.close()


async def test_interleaved_groups_equal_independent_forwards(engine, tiny_model_dir):
    groups = make_groups([40, 57, 33], 5, response=(1, 24), seed=1, shared_start=6)
    arrivals = interleaved(groups, seed=2)
    prefix = engine._prefix
    passes_before = prefix.group_passes
    kinds = [dict(topk=5), dict(topk=3, hidden=True), dict(score_ids=True), dict(temperature=0.7, topk=2), {}]
    requests = [request_of(m, **kinds[i % len(kinds)]) for i, m in enumerate(arrivals)]
    # Rollouts finish over time: three batches, each mixing members of every group.
    outcomes = []
    for lo, hi in ((0, 4), (4, 9), (9, len(requests))):
        outcomes += await engine.score(requests[lo:hi])
    for request, result in zip(requests, outcomes, strict=True):
        assert_exact(result, request, tiny_model_dir)
    reused = [r.prompt_reused_tokens for r in outcomes]
    # Each prompt was computed once (one leader per group), every other member reused it whole.
    assert sorted(t for t in reused if t == 0) == [0, 0, 0]
    for request, tokens in zip(requests, reused, strict=True):
        assert tokens in (0, request.first_row)
    assert sum(1 for t in reused if t) == len(requests) - 3
    assert prefix.group_passes > passes_before


async def test_one_batch_of_a_whole_group_prefills_its_prompt_once(engine, tiny_model_dir):
    (group,) = make_groups([64], 8, response=(2, 20), seed=5)
    requests = [request_of(m, topk=4, hidden=True) for m in group]
    passes, group_passes = engine.forward_passes, engine._prefix.group_passes
    outcomes = await engine.score(requests)
    # One padded pass for the leader, one batched pass for the seven others against its KV.
    assert engine.forward_passes - passes == 1
    assert engine._prefix.group_passes - group_passes == 1
    assert [r.prompt_reused_tokens for r in outcomes] == [0] + [64] * 7
    for request, result in zip(requests, outcomes, strict=True):
        assert_exact(result, request, tiny_model_dir)


async def test_short_prompts_and_reuse_off_are_scored_whole(tiny_model_dir):
    off = await _engine(tiny_model_dir, prompt_reuse=False)
    try:
        assert off._prefix is None
        (group,) = make_groups([40], 3, response=(2, 9), seed=3)
        outcomes = await off.score([request_of(m) for m in group])
        assert all(r.prompt_reused_tokens is None for r in outcomes)
        for member, result in zip(group, outcomes, strict=True):
            assert_exact(result, request_of(member), tiny_model_dir)
    finally:
        await off.close()
    on = await _engine(tiny_model_dir)
    try:
        (short,) = make_groups([15], 3, response=(2, 9), seed=4)  # below prompt_reuse_min_tokens
        outcomes = await on.score([request_of(m) for m in short])
        assert all(r.prompt_reused_tokens is None for r in outcomes) and len(on._prefix.cache) == 0
    finally:
        await on.close()


async def test_a_weight_swap_forgets_cached_prompts(tiny_model_dir, other_model_dir):
    engine = await _engine(tiny_model_dir)
    try:
        (group,) = make_groups([32], 2, response=(3, 8), seed=6)
        await engine.score([request_of(group[0])])
        assert len(engine._prefix.cache) == 1
        other = create_engine(EngineSpec(name="torch", model_path=str(tiny_model_dir), dtype="float32"))
        await other.start()
        state = {k: v + 0.01 for k, v in other.module.state_dict().items()}
        engine.module.load_state_dict(state)  # what a swap group does through `module`
        assert len(engine._prefix.cache) == 0
        (result,) = await engine.score([request_of(group[1])])
        assert result.prompt_reused_tokens == 0
        other.module.load_state_dict(state)
        (expected,) = await other.score([request_of(group[1])])
        torch.testing.assert_close(result.logprobs, expected.logprobs, rtol=0, atol=1e-5)
        await other.close()
    finally:
        await engine.close()


def test_the_cache_is_lru_bounded_by_bytes_and_expires():
    now = [0.0]
    cache: PromptCache[str] = PromptCache(memory_bytes=1000, ttl_s=10.0, clock=lambda: now[0])
    prompts = {k: torch.full((10,), i, dtype=torch.long) for i, k in enumerate((b"a", b"b", b"c"))}  # 80 B each
    assert cache.put(b"a", prompts[b"a"], "A", 300) and cache.put(b"b", prompts[b"b"], "B", 300)
    assert cache.get(b"a", prompts[b"a"]) == "A"  # a is now the most recent
    assert cache.put(b"c", prompts[b"c"], "C", 300)  # 3 * 380 > 1000: b (least recent) goes
    assert cache.get(b"b", prompts[b"b"]) is None and cache.get(b"a", prompts[b"a"]) == "A"
    assert cache.nbytes == 760 and cache.stats.evictions == 1
    assert cache.get(b"a", prompts[b"c"]) is None  # same key, another prompt: never a hit
    assert not cache.put(b"d", prompts[b"a"], "D", 2000) and cache.stats.refused == 1
    now[0] = 9.0
    assert cache.get(b"c", prompts[b"c"]) == "C"
    now[0] = 15.0  # a was last used at 0: expired; c at 9: alive
    assert cache.get(b"a", prompts[b"a"]) is None and cache.get(b"c", prompts[b"c"]) == "C"
    assert len(cache) == 1


def test_settings_are_read_and_checked():
    settings = ReuseSettings.from_inference({"prompt_reuse": "false", "prompt_reuse_memory_mb": 64})
    assert not settings.enabled and settings.memory_bytes == 64 << 20
    assert ReuseSettings.from_inference(None) == ReuseSettings()
    for bad in ({"prompt_reuse": "sometimes"}, {"prompt_reuse_min_tokens": 0}, {"prompt_reuse_ttl_s": "x"},
                {"prompt_reuse_memory_mb": -1}):
        with pytest.raises(ReuseSettingError, match=next(iter(bad))):
            ReuseSettings.from_inference(bad)
    assert isinstance(TorchPrefix(ReuseSettings()).cache, PromptCache)


def test_the_config_schema_declares_the_settings():
    from pydantic import ValidationError

    from proctor.server.config.schema import InferenceConfig

    block = InferenceConfig(prompt_reuse=False, prompt_reuse_min_tokens=512)
    assert ReuseSettings.from_inference(block.model_dump()) == ReuseSettings(enabled=False, min_tokens=512)
    assert ReuseSettings.from_inference(InferenceConfig().model_dump()) == ReuseSettings()
    with pytest.raises(ValidationError, match="prompt_reuse_min_tokens"):
        InferenceConfig(prompt_reuse_min_tokens=0)


# -- the start-time probe of transformers' cache internals ----------------------------------------
# The reuse path builds on `DynamicCache(ddp_cache_data=...)`, a two-argument
# `DynamicLayer.lazy_initialization` and `Cache(layer_class_to_replicate=...)`. Each fake below makes
# one of them behave as another transformers release would; only transformers is faked.


def _refuses_ddp_cache_data(monkeypatch):
    """Releases whose DynamicCache took its layers as `_distributed_cache_data`."""
    from transformers import cache_utils

    real = cache_utils.DynamicCache

    class OlderDynamicCache(real):
        def __init__(self, _distributed_cache_data=None, **kwargs):
            if "ddp_cache_data" in kwargs:
                raise TypeError("DynamicCache.__init__() got an unexpected keyword argument 'ddp_cache_data'")
            super().__init__(**kwargs)

    monkeypatch.setattr(cache_utils, "DynamicCache", OlderDynamicCache)


def _one_argument_lazy_initialization(monkeypatch):
    """Releases whose layers initialised from the keys alone: `lazy_initialization(key_states)`."""
    from transformers import cache_utils

    def lazy_initialization(self, key_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.tensor([], dtype=self.dtype, device=self.device)
        self.values = torch.tensor([], dtype=self.dtype, device=self.device)
        self.is_initialized = True

    monkeypatch.setattr(cache_utils.DynamicLayer, "lazy_initialization", lazy_initialization)


def _reads_pairs_in_another_order(monkeypatch):
    """A release that takes `ddp_cache_data` without complaint but reads each pair the other way
    round: nothing raises, the rows are silently wrong."""
    from transformers import cache_utils

    real = cache_utils.DynamicCache

    class SwappedDynamicCache(real):
        def __init__(self, ddp_cache_data=None, **kwargs):
            pairs = None if ddp_cache_data is None else [(v, k) for k, v in ddp_cache_data]
            super().__init__(ddp_cache_data=pairs, **kwargs)

    monkeypatch.setattr(cache_utils, "DynamicCache", SwappedDynamicCache)


@pytest.mark.parametrize("misbehave", [_refuses_ddp_cache_data, _one_argument_lazy_initialization,
                                       _reads_pairs_in_another_order])
async def test_cache_internals_that_misbehave_turn_reuse_off_with_one_line(misbehave, monkeypatch, caplog,
                                                                           tiny_model_dir):
    misbehave(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="proctor.server.engines.torch.prefix"):
        engine = await _engine(tiny_model_dir)  # starts: the replica does not fail
    try:
        lines = [r.getMessage() for r in caplog.records if "prompt reuse off" in r.getMessage()]
        assert len(lines) == 1 and "transformers" in lines[0] and "scored whole" in lines[0]
        assert engine._prefix is None
        (group,) = make_groups([40], 4, response=(1, 12), seed=7)
        requests = [request_of(m, topk=4, hidden=True) for m in group]
        outcomes = await engine.score(requests)
        assert all(r.prompt_reused_tokens is None for r in outcomes)
        for request, result in zip(requests, outcomes, strict=True):
            assert_exact(result, request, tiny_model_dir)
    finally:
        await engine.close()


async def test_the_real_internals_pass_the_probe_and_reuse_stays_on(caplog, tiny_model_dir):
    with caplog.at_level(logging.WARNING, logger="proctor.server.engines.torch.prefix"):
        for dtype in ("float32", "bfloat16"):
            engine = create_engine(EngineSpec(name="torch", model_path=str(tiny_model_dir), dtype=dtype,
                                              inference=REUSE))
            await engine.start()
            try:
                assert engine._prefix is not None, dtype
                assert reuse_works(engine._model.get_decoder(), engine._padded_pass)
            finally:
                await engine.close()
    assert not [r for r in caplog.records if "prompt reuse off" in r.getMessage()]
