"""Shared-prefix scoring on the torch engine: a group's prompt is prefilled once and kept, every
member still equals an independent uncached forward (float32, 1e-5; top-k ids equal), with or
without a prompt length: the engine finds the shared prefix itself.

The traffic is GRPO-shaped (`support.groups`): interleaved groups, members in shuffled order and in
several batches (as rollouts finish), one-token responses, a member whose response starts like
another's, hidden states, score_ids and temperature on the cached path.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from proctor.server.engines.base import EngineSpec
from proctor.server.engines.factory import create_engine
from proctor.server.engines.prompt_reuse import PrefixStore, ReuseSettingError, ReuseSettings, block_hashes
from proctor.server.engines.torch.prefix import TorchPrefix
from proctor.server.engines.torch.reuse_probe import reuse_works

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
    # Each prompt was computed once (one leader per group); every other member skipped at least its
    # prompt but the last position, which gives its first response row.
    assert sorted(t for t in reused if t == 0) == [0, 0, 0]
    for request, result in zip(requests, outcomes, strict=True):
        assert result.prompt_reused_tokens == 0 or result.prompt_reused_tokens >= request.first_row - 1
        assert result.computed_tokens == request.num_tokens - (1 if result.prompt_reused_tokens else 0) - (
            result.prompt_reused_tokens or 0)
    assert prefix.group_passes > passes_before


async def test_one_batch_of_a_whole_group_prefills_its_prompt_once(engine, tiny_model_dir):
    (group,) = make_groups([64], 8, response=(2, 20), seed=5)
    requests = [request_of(m, topk=4, hidden=True) for m in group]
    passes, group_passes = engine.forward_passes, engine._prefix.group_passes
    outcomes = await engine.score(requests)
    # One padded pass for the leader, one batched pass for the seven others against its KV.
    assert engine.forward_passes - passes == 1
    assert engine._prefix.group_passes - group_passes == 1
    assert [r.prompt_reused_tokens for r in outcomes] == [0] + [63] * 7
    for request, result in zip(requests, outcomes, strict=True):
        assert_exact(result, request, tiny_model_dir)


async def test_without_a_prompt_length_members_copy_their_prefix_rows(engine, tiny_model_dir):
    groups = make_groups([48, 70], 6, response=(1, 20), seed=11, shared_start=5)
    arrivals = interleaved(groups, seed=3)
    requests = [request_of(m, topk=4, score_ids=True, hidden=True, whole=True) for m in arrivals]
    outcomes = []
    for lo, hi in ((0, 3), (3, 7), (7, len(requests))):
        outcomes += await engine.score(requests[lo:hi])
    for request, result in zip(requests, outcomes, strict=True):
        assert result.first_row == 1
        assert_exact(result, request, tiny_model_dir)
    by_group = {}
    for member, result in zip(arrivals, outcomes, strict=True):
        by_group.setdefault(member.group, []).append((member, result))
    for members in by_group.values():
        (leader,) = [r for _, r in members if r.prompt_reused_tokens == 0]
        for member, result in members:
            if result is leader:
                assert result.computed_tokens == member.token_ids.shape[0]
                continue
            # Rows 1..past were copied from the group's first member; only positions past..T-2 ran.
            assert result.prompt_reused_tokens >= member.prompt_length - 1
            assert result.computed_tokens == member.token_ids.shape[0] - 1 - result.prompt_reused_tokens


async def test_a_member_asking_more_than_its_source_holds_computes_those_rows(engine, tiny_model_dir):
    (group,) = make_groups([50], 4, response=(4, 9), seed=13)
    first, second = (request_of(m, topk=2, whole=True, ranks=False) for m in group[:2])
    wider = request_of(group[1], topk=6, whole=True, ranks=False)  # wider top-k than the record holds
    warmer = request_of(group[2], topk=2, temperature=0.5, whole=True, ranks=False)  # another temperature
    ranked = request_of(group[3], topk=2, whole=True)  # the ranks, which the record left out
    outcomes = await engine.score([first])
    outcomes += await engine.score([wider, warmer, ranked])
    for request, result in zip([first, wider, warmer, ranked], outcomes, strict=True):
        assert_exact(result, request, tiny_model_dir)
    # Nothing could be copied, and rows from 1 are wanted: no prefix position could be skipped.
    assert [r.prompt_reused_tokens for r in outcomes] == [0, 0, 0, 0]
    assert [r.computed_tokens for r in outcomes] == [r.num_tokens for r in (first, wider, warmer, ranked)]
    (again,) = await engine.score([second])  # the same ask as the first member: copied again
    assert again.prompt_reused_tokens >= 49
    assert_exact(again, second, tiny_model_dir)


async def test_score_ids_that_differ_inside_the_prefix_stop_the_copy_there(engine, tiny_model_dir):
    (group,) = make_groups([40], 2, response=(5, 8), seed=17)
    leader = request_of(group[0], score_ids=True, whole=True)
    follower = request_of(group[1], score_ids=True, whole=True)
    changed = follower.score_ids.copy()
    changed[20, 0] = (changed[20, 0] + 1) % 500  # row 21's ids differ from the leader's
    follower = replace(follower, score_ids=changed)
    outcomes = await engine.score([leader])
    (result,) = await engine.score([follower])
    assert_exact(outcomes[0], leader, tiny_model_dir)
    assert_exact(result, follower, tiny_model_dir)
    assert result.prompt_reused_tokens == 20  # rows 1..20 copied, rows 21.. computed


async def test_short_prefixes_and_reuse_off_are_scored_whole(tiny_model_dir):
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
        (short,) = make_groups([15], 3, response=(2, 9), seed=4)  # shares fewer than prompt_reuse_min_tokens
        outcomes = await on.score([request_of(m, whole=True) for m in short])
        assert [r.prompt_reused_tokens for r in outcomes] == [0, 0, 0]
        assert [r.computed_tokens for r in outcomes] == [m.token_ids.shape[0] for m in short]
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


def test_the_store_is_lru_bounded_by_bytes_and_expires():
    now = [0.0]
    store: PrefixStore[str] = PrefixStore(memory_bytes=1500, ttl_s=10.0, block_tokens=4, clock=lambda: now[0])
    seqs = {k: torch.arange(i * 100, i * 100 + 12) for i, k in enumerate("abc")}  # 48 B (int32) + 3 hashes each
    a, b = store.put(seqs["a"], "A", 400), store.put(seqs["b"], "B", 400)
    assert a and b and store.find(seqs["a"]).value == "A"  # a is now the most recent
    assert store.put(seqs["c"], "C", 400)  # 3 * 568 > 1500: b (least recent) goes
    assert store.find(seqs["b"]) is None and store.find(seqs["a"]).value == "A"
    assert store.nbytes == 2 * 568 and store.stats.evictions == 1
    assert store.put(seqs["a"], "D", 4000) is None and store.stats.refused == 1
    now[0] = 9.0
    assert store.find(seqs["c"]).value == "C"
    now[0] = 15.0  # a was last used at 0: expired; c at 9: alive
    assert store.find(seqs["a"]) is None and store.find(seqs["c"]).value == "C"
    assert len(store) == 1


def test_a_lookup_finds_the_longest_shared_prefix_and_counts_it_exactly():
    store: PrefixStore[str] = PrefixStore(memory_bytes=1 << 20, ttl_s=60.0, block_tokens=4)
    base = torch.arange(40)
    store.put(base[:30], "short", 0)
    store.put(torch.cat([base[:22], torch.tensor([999] * 10)]), "forked", 0)
    found = store.find(torch.cat([base[:27], torch.tensor([7, 7, 7])]))
    assert (found.value, found.shared) == ("short", 27)  # exact, though blocks end at 24
    found = store.find(torch.cat([base[:22], torch.tensor([999, 5])]))
    assert (found.value, found.shared) == ("forked", 23)
    assert store.find(base[:30] + 1000) is None
    assert store.find(torch.cat([base[:6], torch.tensor([1] * 20)]), at_least=8) is None


def test_a_colliding_hash_never_hands_over_another_sequences_prefix():
    store: PrefixStore[str] = PrefixStore(memory_bytes=1 << 20, ttl_s=60.0, block_tokens=4)
    theirs, mine = torch.arange(16), torch.arange(100, 116)
    store.put(theirs, "theirs", 0, hashes=block_hashes(mine, 4))  # as if every block hash collided
    assert store.find(mine, at_least=4) is None  # the tokens are compared: nothing is shared
    assert store.find(mine) is None


def test_settings_are_read_and_checked():
    settings = ReuseSettings.from_inference({"prompt_reuse": "false", "prompt_reuse_memory_mb": 64})
    assert not settings.enabled and settings.memory_bytes == 64 << 20
    assert ReuseSettings.from_inference(None) == ReuseSettings()
    for bad in ({"prompt_reuse": "sometimes"}, {"prompt_reuse_min_tokens": 0}, {"prompt_reuse_ttl_s": "x"},
                {"prompt_reuse_memory_mb": -1}):
        with pytest.raises(ReuseSettingError, match=next(iter(bad))):
            ReuseSettings.from_inference(bad)
    assert isinstance(TorchPrefix(ReuseSettings()).cache, PrefixStore)


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
