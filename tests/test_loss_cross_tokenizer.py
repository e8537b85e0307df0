"""Cross-tokenizer losses against float64 references written one chunk / one row at a time."""

from __future__ import annotations

import pytest
import torch

from proctor.client import AlignedScores, TeacherScores, pack_aligned
from proctor.client.loss import chunk_likelihood_loss, gold_hybrid_loss
from proctor.client.loss.cross_tokenizer import CHUNK_LOGPROB_CEILING

from loss_reference import chunk_likelihood_ref, gold_hybrid_ref, rel_err

F64 = torch.float64


def _chunk_case(seed: int, rows: int = 23):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 4, (rows,), generator=g)
    chunk_ids = torch.repeat_interleave(torch.arange(rows), sizes)[:rows]
    student = -torch.rand(rows, generator=g, dtype=F64) * 3
    teacher_per_chunk = -torch.rand(int(chunk_ids.max()) + 1, generator=g, dtype=F64) * 6
    teacher_per_chunk[0] = -1e-9  # a chunk the teacher is sure of: held below the ceiling
    return student, chunk_ids, teacher_per_chunk[chunk_ids]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunk_likelihood_loss_matches_the_float64_reference_with_gradients(seed):
    student, chunk_ids, teacher = _chunk_case(seed)
    student32 = student.float().requires_grad_()
    got = chunk_likelihood_loss(student32, chunk_ids, teacher.float())
    reference_input = student.clone().requires_grad_()
    want = chunk_likelihood_ref(reference_input, chunk_ids.tolist(), teacher.tolist(), CHUNK_LOGPROB_CEILING)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got, want) < 1e-5 and (want >= -1e-12).all()
    got.sum().backward()
    want.sum().backward()
    assert rel_err(student32.grad, reference_input.grad) < 1e-4


def test_chunk_likelihood_loss_is_zero_where_the_likelihoods_agree_and_passes_gradcheck():
    student, chunk_ids, _ = _chunk_case(5)
    sums = torch.zeros(int(chunk_ids.max()) + 1, dtype=F64).index_add(0, chunk_ids, student)
    assert chunk_likelihood_loss(student, chunk_ids, sums[chunk_ids]).abs().max() < 1e-12
    teacher = sums[chunk_ids] - 0.7
    assert torch.autograd.gradcheck(lambda s: chunk_likelihood_loss(s, chunk_ids, teacher),
                                    (student.clone().requires_grad_(),))


def _gold_case(seed: int, rows: int = 12, vocab: int = 17, k: int = 5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=F64) * 2
    ids = torch.randint(0, vocab, (rows, k), generator=g)
    ids[torch.rand(rows, k, generator=g) < 0.3] = -1
    logprobs = torch.log_softmax(torch.randn(rows, vocab, generator=g, dtype=F64), -1)[:, :k].sort(
        descending=True).values
    logprobs = torch.where(ids >= 0, logprobs, float("-inf"))
    kind = torch.randint(0, 3, (rows,), generator=g)
    uld_teacher = torch.log_softmax(torch.randn(rows, vocab, generator=g, dtype=F64), -1).topk(4).values
    uld_teacher[kind != 1] = float("-inf")
    return logits, ids, logprobs, kind == 0, kind == 1, uld_teacher


@pytest.mark.parametrize(("seed", "temperature"), [(0, 1.0), (1, 0.7), (2, 1.5)])
def test_gold_hybrid_loss_matches_the_float64_reference_with_gradients(seed, temperature):
    logits, ids, logprobs, exact, uld, uld_teacher = _gold_case(seed)
    assert exact.any() and uld.any() and (~exact & ~uld).any()
    student32 = logits.float().requires_grad_()
    got = gold_hybrid_loss(student32, ids, logprobs.float(), exact, uld, uld_teacher.float(), temperature=temperature)
    reference_input = logits.clone().requires_grad_()
    want = gold_hybrid_ref(reference_input, ids.tolist(), logprobs.tolist(), exact.tolist(), uld.tolist(),
                           uld_teacher.tolist(), temperature)
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5
    assert (got[~exact & ~uld] == 0).all()
    got.sum().backward()
    want.sum().backward()
    assert rel_err(student32.grad, reference_input.grad) < 1e-4


def test_gold_hybrid_loss_passes_gradcheck_and_refuses_bad_masks():
    logits, ids, logprobs, exact, uld, uld_teacher = _gold_case(9)
    assert torch.autograd.gradcheck(lambda s: gold_hybrid_loss(s, ids, logprobs, exact, uld, uld_teacher),
                                    (logits.clone().requires_grad_(),))
    with pytest.raises(ValueError, match="both exact and uld"):
        gold_hybrid_loss(logits, ids, logprobs, exact | uld, uld, uld_teacher)
    with pytest.raises(ValueError, match="bool"):
        gold_hybrid_loss(logits, ids, logprobs, exact.long(), uld, uld_teacher)


def test_pack_aligned_offsets_chunks_and_picks_the_teacher_row_at_each_chunk_start():
    teacher = TeacherScores("r", "t", "m", num_tokens=7, first_row=3,
                            topk_logprobs=torch.log(torch.tensor([[0.5, 0.2], [0.6, 0.1], [0.7, 0.2], [0.9, 0.05]])))
    # student rows 2..5: chunk 0 = rows 2 (1:1 with teacher 3); chunk 1 = rows 3-4 with teacher 4-5;
    # chunk 2 = row 5, 1:1 with teacher 6.
    chunks = torch.tensor([[2, 3, 3, 4, 0, 1], [3, 5, 4, 6, 1, 4], [5, 6, 6, 7, 4, 6]], dtype=torch.int32)
    answer = AlignedScores("r", "t", "m", num_tokens=6, first_row=2, chunk_ids=torch.tensor([0, 1, 1, 2]),
                           chunk_logprobs=torch.tensor([-1.0, -2.0, -2.0, -0.5]), chunks=chunks,
                           teacher_ids=torch.arange(7), teacher_scores=teacher,
                           topk_ids=torch.tensor([[4, -1], [-1, -1], [-1, -1], [-1, -1]]),
                           topk_logprobs=torch.tensor([[-0.1, float("-inf")]] + [[float("-inf")] * 2] * 3))
    batch = pack_aligned([answer, answer])
    assert batch.chunk_ids.tolist() == [0, 1, 1, 2, 3, 4, 4, 5]
    assert batch.exact.tolist() == [True, False, False, True] * 2
    assert batch.uld.tolist() == [False, True, False, False] * 2
    torch.testing.assert_close(batch.uld_teacher_logprobs[5], teacher.topk_logprobs[1])  # chunk 1 starts at teacher 4
    assert torch.isinf(batch.uld_teacher_logprobs[[0, 2, 3]]).all()
