"""Batch reassembly: proctor rows → verl's padded teacher tensors (the verl adapter's), and
jagged hidden states (the client's)."""

from __future__ import annotations

import pytest
import torch

from proctor.client import TeacherScores
from proctor.client.batch import (
    hidden_states_batch,
    packed_score_logprobs,
    score_ids_from_rollout,
    student_topk_ids,
)
from proctor.trainer_adapter.verl import pad_verl_rows, verl_hidden_rows, verl_rows, verl_teacher_batch

PAD = 7


def fake_scores(num_tokens: int, first_row: int, *, k: int = 4, hidden: int = 6, teacher: str = "t", seed: int = 0):
    """Scores as a server sends them: rows first_row..T-1 (random values, exact dtypes)."""
    g = torch.Generator().manual_seed(seed)
    rows = num_tokens - first_row
    return TeacherScores(
        request_id=f"r{seed}", teacher=teacher, model="m", num_tokens=num_tokens, first_row=first_row,
        logprobs=-torch.rand(rows, generator=g),
        topk_ids=torch.randint(0, 100, (rows, k), generator=g, dtype=torch.int32),
        topk_logprobs=-torch.rand(rows, k, generator=g),
        hidden_states=torch.randn(rows, hidden, generator=g),
    )


def test_verl_row_i_predicts_token_i_plus_one():
    tokens = [10, 11, 12, 13, 14]
    scores = fake_scores(5, first_row=1)
    ids, lps = verl_rows(scores, tokens, topk=0)
    assert ids.shape == (5, 1) and ids.dtype == torch.int32 and lps.dtype == torch.float32
    assert ids[:4, 0].tolist() == [11, 12, 13, 14]  # row i holds token i + 1
    assert torch.equal(lps[:4, 0], scores.logprobs)  # proctor row i + 1
    assert ids[4].tolist() == [0] and lps[4].tolist() == [0.0]  # verl's dummy last row


def test_verl_rows_before_the_prompts_end_are_zero_when_not_scored():
    scores = fake_scores(8, first_row=5)
    ids, lps = verl_rows(scores, list(range(8)), topk=4)
    assert torch.equal(ids[4:7], scores.topk_ids) and torch.equal(lps[4:7], scores.topk_logprobs)
    assert not ids[:4].any() and not lps[:4].any() and not ids[7].any()


def test_verl_rows_refuse_fewer_topk_than_asked():
    with pytest.raises(ValueError, match="top-8"):
        verl_rows(fake_scores(6, 2, k=4), list(range(6)), topk=8)


def test_verl_batch_pads_prompts_left_and_responses_right():
    prompts, responses = [3, 5], [4, 2]
    tokens = [list(range(100, 100 + p + r)) for p, r in zip(prompts, responses, strict=True)]
    scores = [fake_scores(p + r, p, seed=i) for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    out = verl_teacher_batch(scores, tokens, prompts, prompt_width=6, response_width=5, topk=4, pad_token_id=PAD)
    ids, lps = out["teacher_ids"], out["teacher_logprobs"]
    assert ids.shape == lps.shape == (2, 11, 4)
    # sequence 0: prompt of 3 sits at columns 3..5; its response rows 3..6 at columns 5..8
    assert (ids[0, :3] == PAD).all() and (lps[0, :3] == 0).all()
    assert torch.equal(ids[0, 5:8], scores[0].topk_ids[:3])  # last prompt token + 2 response tokens
    assert (ids[0, 10:] == PAD).all()  # tokens 0..6 fill columns 3..9
    # sequence 1: prompt of 5 at columns 1..5, response of 2 at 6..7, padding from column 8
    assert (ids[1, :1] == PAD).all() and (ids[1, 8:] == PAD).all()
    assert torch.equal(lps[1, 5:7], scores[1].topk_logprobs)  # rows 5, 6 at columns 5, 6


@pytest.mark.parametrize("topk", [0, 4])
def test_verl_batch_round_trips_exactly(topk):
    prompts, responses = [3, 6, 1], [5, 1, 7]
    tokens = [torch.randint(0, 50, (p + r,)) for p, r in zip(prompts, responses, strict=True)]
    scores = [fake_scores(p + r, p, seed=i) for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    out = verl_teacher_batch(scores, tokens, prompts, prompt_width=6, response_width=7, topk=topk, pad_token_id=PAD)
    for b, (score, seq, prompt) in enumerate(zip(scores, tokens, prompts, strict=True)):
        # Read back as a verl trainer does: token 0 sits at column 6 - prompt, and proctor's
        # row j (j >= first_row) is verl's row j - 1, one column left of token j.
        cols = slice(6 - prompt + score.first_row - 1, 6 - prompt + len(seq) - 1)
        ids, lps = out["teacher_ids"][b, cols], out["teacher_logprobs"][b, cols]
        if topk:
            assert torch.equal(ids, score.topk_ids) and torch.equal(lps, score.topk_logprobs)
        else:
            assert torch.equal(ids[:, 0].long(), seq[score.first_row :])
            assert torch.equal(lps[:, 0], score.logprobs)


def test_pad_verl_rows_matches_verls_own_padding():
    manager = pytest.importorskip("verl.experimental.teacher_loop.teacher_manager")
    ids = torch.randint(0, 100, (9, 3), dtype=torch.int32)
    lps = -torch.rand(9, 3)
    want_ids, want_lps = manager._pad_teacher_outputs(
        ids, lps, prompt_width=8, response_width=6, prompt_length=4, response_length=5, pad_token_id=PAD
    )
    layout = {"prompt_length": 4, "prompt_width": 8, "response_width": 6}
    assert torch.equal(pad_verl_rows(ids, value=PAD, **layout), want_ids)
    assert torch.equal(pad_verl_rows(lps, value=0.0, **layout), want_lps)


def test_pad_verl_rows_refuses_a_sequence_wider_than_the_batch():
    with pytest.raises(ValueError, match="does not fit"):
        pad_verl_rows(torch.zeros(10, 1), prompt_length=4, prompt_width=3, response_width=8, value=0)


def test_hidden_states_batch_is_jagged_and_round_trips():
    scores = [fake_scores(9, 4, seed=1), fake_scores(5, 1, seed=2), fake_scores(12, 11, seed=3)]
    batch = hidden_states_batch(scores)
    assert batch.hidden_states.is_nested and batch.hidden_states.size(0) == 3
    assert [h.shape[0] for h in batch.hidden_states.unbind()] == [5, 4, 1]
    for got, score in zip(batch.per_sequence(), scores, strict=True):
        assert torch.equal(got, score.hidden_states)
    hidden, index = batch.packed()
    assert torch.equal(hidden, torch.cat([s.hidden_states for s in scores]))
    assert hidden.shape == (10, 6) and index.tolist() == [0] * 10 and batch.teachers == ["t"]


def test_hidden_states_batch_keeps_each_tokens_teacher_and_pads_smaller_hidden_sizes():
    scores = [fake_scores(6, 3, teacher="a", hidden=6), fake_scores(5, 2, teacher="b", hidden=4, seed=1),
              fake_scores(4, 1, teacher="a", hidden=6, seed=2)]
    batch = hidden_states_batch(scores)
    hidden, index = batch.packed()
    assert batch.teachers == ["a", "b"] and batch.hidden_sizes == {"a": 6, "b": 4}
    assert index.tolist() == [0] * 3 + [1] * 3 + [0] * 3
    assert not hidden[3:6, 4:].any()  # teacher b zero-padded to the widest hidden size
    for got, score in zip(batch.per_sequence(), scores, strict=True):
        assert torch.equal(got, score.hidden_states)


def test_verl_hidden_rows_follow_verls_shift():
    scores = fake_scores(7, 3)
    rows = verl_hidden_rows(scores)
    assert rows.shape == (7, 6)
    assert torch.equal(rows[2:6], scores.hidden_states)  # position i predicts token i + 1
    assert not rows[:2].any() and not rows[6].any()


def test_score_ids_from_the_students_logits_and_from_a_rollout_engines_top_logprobs():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, 0.0, 1.0, -2.0]])
    assert student_topk_ids(logits, 2).tolist() == [[1, 3], [0, 2]]
    assert student_topk_ids(logits, 2).dtype == torch.int32
    with pytest.raises(ValueError, match="k must be"):
        student_topk_ids(logits, 5)

    class Logprob:  # vLLM's per-token entry: the sampled token first, then ranks 1..k
        def __init__(self, rank):
            self.rank = rank

    per_token = [{9: Logprob(3), 4: Logprob(1), 7: Logprob(2)}, {5: Logprob(1)}, [8, 2]]
    assert score_ids_from_rollout(per_token).tolist() == [[4, 7, 9], [5, -1, -1], [8, 2, -1]]
    assert score_ids_from_rollout(per_token, k=2).tolist() == [[4, 7], [5, -1], [8, 2]]


def test_packed_score_logprobs_pad_narrower_sequences_with_minus_inf():
    a = TeacherScores("a", "t", "m", 4, 2, score_logprobs=torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]))
    b = TeacherScores("b", "t", "m", 3, 2, score_logprobs=torch.tensor([[-5.0]]))
    packed = packed_score_logprobs([a, b])
    assert packed.tolist() == [[-1.0, -2.0], [-3.0, -4.0], [-5.0, float("-inf")]]
    with pytest.raises(ValueError, match="score_ids"):
        packed_score_logprobs([TeacherScores("c", "t", "m", 3, 2)])
