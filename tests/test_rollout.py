"""The rollout hook: scoring overlaps generation, results complete, routing never guesses."""

from __future__ import annotations

import asyncio
import time

import pytest

from proctor.client import TeacherClient
from proctor.trainer_adapter.rollout import RolloutSample, RolloutScorer, RoutingError

from support.reference import assert_matches_reference
from support.servers import request_count


def sample(i: int, source: str | None = "openai/gsm8k") -> RolloutSample:
    meta = {"uid": i} if source is None else {"data_source": source, "uid": i}
    return RolloutSample(prompt_ids=[(3 * i + j) % 512 for j in range(5)],
                         response_ids=[(5 * i + j) % 512 for j in range(3 + i % 4)], meta=meta)


async def test_scores_arrive_while_the_rollout_is_still_generating(torch_server, tiny_model_dir):
    finished_at: list[float] = []

    async def rollout():
        for i in range(8):
            await asyncio.sleep(0.05)  # generating the next sequence
            yield sample(i, None)
        finished_at.append(time.monotonic())

    got = []
    async with TeacherClient(f"grpc://{torch_server.grpc_target}") as client:
        scorer = RolloutScorer(client, key_column=None)
        async for scored in scorer.scored(rollout()):
            got.append((time.monotonic(), scored))
    first_result = min(t for t, _ in got)
    assert first_result < finished_at[0]  # overlap: scored before generation ended
    assert sorted(s.index for _, s in got) == list(range(8))
    for _, scored in got:
        s = scored.sample
        assert scored.scores.first_row == s.prompt_length  # response rows only
        assert_matches_reference(scored.scores.logprobs, tiny_model_dir, s.token_ids, first_row=s.prompt_length,
                                 atol=1e-4)


async def test_samples_route_by_data_source_to_their_teacher(two_teachers, tiny_model_dir, other_model_dir):
    model_dirs = {"math": tiny_model_dir, "geo": other_model_dir}
    samples = [sample(i, "openai/gsm8k" if i % 3 else "hiyouga/geometry3k") for i in range(9)]
    async with TeacherClient(f"grpc://{two_teachers.grpc_target}") as client:
        scorer = RolloutScorer(client)
        results = [s async for s in scorer.scored(samples)]
    assert len(results) == 9
    for scored in results:
        want_teacher = "geo" if scored.sample.meta["data_source"] == "hiyouga/geometry3k" else "math"
        assert scored.teacher_key == want_teacher and scored.scores.teacher == want_teacher
        s = scored.sample
        assert_matches_reference(scored.scores.logprobs, model_dirs[want_teacher], s.token_ids,
                                 first_row=s.prompt_length, atol=1e-4)


async def test_a_sample_without_the_key_column_raises_and_sends_nothing(two_teachers):
    before = request_count(two_teachers, "ok")
    async with TeacherClient(f"grpc://{two_teachers.grpc_target}") as client:
        scorer = RolloutScorer(client)
        with pytest.raises(RoutingError, match="no 'data_source' column"):
            async for _ in scorer.scored([sample(0, None)]):
                pass
    assert request_count(two_teachers, "ok") == before


async def test_an_unknown_key_raises_instead_of_falling_back(two_teachers):
    async with TeacherClient(f"grpc://{two_teachers.grpc_target}") as client:
        scorer = RolloutScorer(client)
        await scorer.resolve_routes()
        with pytest.raises(RoutingError, match="no teacher for data_source='lmsys/chat'"):
            scorer.submit(sample(0, "lmsys/chat"))


async def test_an_explicit_teacher_map_overrides_the_catalogue(two_teachers):
    async with TeacherClient(f"grpc://{two_teachers.grpc_target}") as client:
        scorer = RolloutScorer(client, key_column="task", teacher_map={"algebra": "math", "shapes": "geo"})
        scored = await scorer.score(RolloutSample([1, 2, 3], [4, 5], meta={"task": "shapes"}))
    assert scored.scores.teacher == "geo"


async def test_submit_hook_returns_results_in_submission_order(two_teachers):
    async with TeacherClient(f"grpc://{two_teachers.grpc_target}") as client:
        scorer = RolloutScorer(client, topk=4)
        await scorer.resolve_routes()
        samples = [sample(i) for i in range(6)]
        for s in samples:
            scorer.submit(s)  # e.g. from the rollout loop's on-finish callback
        results = await scorer.gather()
    assert [r.sample for r in results] == samples
    assert all(r.scores.topk_ids.shape[1] == 4 for r in results)
    assert scorer.scored_sequences == 6
