"""Per-sequence teacher scores → the batch tensors a trainer's loss consumes.

Hidden states stay jagged: a nested tensor of each sequence's response rows, with the teacher
of every token, which is what the chunked full-vocabulary loss takes (`packed()`). Layouts of
one trainer (verl's padded `teacher_ids` / `teacher_logprobs`) live with that trainer's adapter
(`proctor.trainer_adapter.verl`).

score_ids (the teacher scored at the student's top-k): `student_topk_ids` builds them from the
student's logits at the rollout, `score_ids_from_rollout` from a rollout engine's per-token top
log-probs, and `packed_score_logprobs` packs the answers for `student_topk_reverse_kl`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from proctor.client.client import TeacherScores
from proctor.proto import hidden_forms


@dataclass
class HiddenStatesBatch:
    """Response-row hidden states of a batch, jagged, with the teacher of every token.

    `hidden_states`: nested (jagged) [B, R_b, H_max] (a teacher with a smaller hidden size is
    zero-padded on the right). `teacher_index`: nested [B, R_b] int64 into `teachers`.
    Row r of sequence b is the teacher state that predicts token first_rows[b] + r, so it pairs
    with the student's activation at position first_rows[b] + r - 1.
    """

    hidden_states: torch.Tensor
    teacher_index: torch.Tensor
    teachers: list[str]
    hidden_sizes: dict[str, int]
    first_rows: list[int]

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [N, H_max], teacher_index [N]) in sequence order, for `full_vocab_kl`."""
        return self.hidden_states.values(), self.teacher_index.values()

    def per_sequence(self) -> list[torch.Tensor]:
        """Each sequence's [R_b, H_teacher] rows, unpadded (the inverse of `hidden_states_batch`)."""
        out = []
        for hidden, index in zip(self.hidden_states.unbind(), self.teacher_index.unbind(), strict=True):
            teacher = self.teachers[int(index[0])]
            out.append(hidden[:, : self.hidden_sizes[teacher]])
        return out


def hidden_states_batch(scores: Sequence[TeacherScores]) -> HiddenStatesBatch:
    """Stack the sequences' hidden states into one jagged batch (no padding to a common length)."""
    if not scores:
        raise ValueError("no sequences to batch")
    teachers: list[str] = []
    sizes: dict[str, int] = {}
    for score in scores:
        if score.hidden_states is None:
            raise ValueError(f"request {score.request_id} has no hidden states; score with hidden_states=True")
        size = score.hidden_states.shape[1]
        if sizes.setdefault(score.teacher, size) != size:
            raise ValueError(f"teacher {score.teacher!r} sent hidden sizes {sizes[score.teacher]} and {size}")
        if score.teacher not in teachers:
            teachers.append(score.teacher)
    packed = {hidden_forms.is_fp8_rows(s.hidden_states) for s in scores}
    if True in packed and (len(packed) > 1 or len(set(sizes.values())) > 1):  # a row's scale sits at its end
        raise ValueError("packed fp8 hidden rows batch only with packed rows of one width; dequantise them "
                         "first (proctor.proto.hidden_forms.dequantize_rows)")
    h_max = max(sizes.values())
    dtype = scores[0].hidden_states.dtype
    rows, index = [], []
    for score in scores:
        hidden = score.hidden_states.to(dtype)
        if hidden.shape[1] < h_max:
            hidden = torch.nn.functional.pad(hidden, (0, h_max - hidden.shape[1]))
        rows.append(hidden)
        index.append(torch.full((hidden.shape[0],), teachers.index(score.teacher), dtype=torch.int64))
    return HiddenStatesBatch(
        hidden_states=torch.nested.nested_tensor(rows, layout=torch.jagged),
        teacher_index=torch.nested.nested_tensor(index, layout=torch.jagged),
        teachers=teachers,
        hidden_sizes=sizes,
        first_rows=[s.first_row for s in scores],
    )


def student_topk_ids(student_logits: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [R, k] score_ids: the student's k most likely ids per response row, from its logits
    (or log-probs) at the rollout, row r predicting token first_row + r."""
    if student_logits.dim() != 2:
        raise ValueError(f"student_logits must be [rows, V], got shape {tuple(student_logits.shape)}")
    if not 1 <= k <= student_logits.shape[1]:
        raise ValueError(f"k must be in [1, {student_logits.shape[1]}], got {k}")
    return torch.topk(student_logits.detach(), k, dim=-1).indices.to(torch.int32)


def score_ids_from_rollout(token_logprobs: Sequence[Mapping[int, Any] | Sequence[int]], k: int | None = None) -> torch.Tensor:
    """int32 [R, K] score_ids from a rollout engine's per-token top log-probs, one entry per
    generated token (vLLM's `CompletionOutput.logprobs`: {token id: Logprob}, which may hold the
    sampled token beside the top-k): most likely first (by `rank` where given), at most `k` a row,
    -1 padding where a row has fewer."""
    rows = []
    for entry in token_logprobs:
        if isinstance(entry, Mapping):
            ranked = sorted(entry.items(), key=lambda item: getattr(item[1], "rank", None) or 1 << 30)
            ids = [int(token) for token, _ in ranked]
        else:
            ids = [int(token) for token in entry]
        rows.append(ids[:k] if k is not None else ids)
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), -1, dtype=torch.int32)
    for index, ids in enumerate(rows):
        out[index, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def packed_score_logprobs(scores: Sequence[TeacherScores]) -> torch.Tensor:
    """The sequences' score_logprobs packed in sequence order, float32 [N, K_max] (-inf padding
    where a sequence scored fewer ids): the teacher side of `student_topk_reverse_kl`."""
    if not scores:
        raise ValueError("no sequences to pack")
    for score in scores:
        if score.score_logprobs is None:
            raise ValueError(f"request {score.request_id} has no score_logprobs; score with score_ids=...")
    width = max(s.score_logprobs.shape[1] for s in scores)
    parts = [torch.nn.functional.pad(s.score_logprobs.float(), (0, width - s.score_logprobs.shape[1]),
                                     value=float("-inf")) for s in scores]
    return torch.cat(parts)
