"""The answer to an aligned request (a student with another tokenizer), in the student's rows.

`TeacherClient.score(ids, prompt_length=P, student_tokenizer=KEY, teacher_prompt_ids=... |
messages=...)` returns `AlignedScores`: rows P..T-1 of the student's sequence, each student
token with its chunk (the response is cut where both tokenizations end a token), the chunk's
teacher log-likelihood, and at 1:1 chunks the teacher's top-k in student ids; beside them the
alignment (each chunk's student and teacher positions and byte offsets) and the teacher's own
answer over its tokenization. `pack_aligned` lays several of them out as the cross-tokenizer
losses (`proctor.client.loss.cross_tokenizer`) take them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from proctor.client.scores import TeacherScores
from proctor.proto import decode_tensor, scoring_pb2


@dataclass(frozen=True)
class StudentTokenizer:
    """A student tokenizer the server loaded (ListTeachers): compare `fingerprint` with your own
    tokenizer directory's (`proctor.server.engines.fingerprint.model_fingerprint` digests the same files)."""

    key: str
    vocab_size: int
    fingerprint: str


@dataclass
class AlignedScores:
    """An aligned answer: rows first_row..num_tokens-1 of the student's sequence (R rows).

    `chunk_ids[r]` is row r's chunk (0, 1, ... in order), `chunk_logprobs[r]` the teacher's
    log-likelihood of that chunk (the same for every row of it). `topk_ids` / `topk_logprobs`
    ([R, K], when a top-k was asked) are the teacher's top-k in student ids at rows whose chunk is
    one student and one teacher token, -1 / -inf elsewhere and where an id has no exact match;
    `unmapped_mass` the top-k mass of those unmatched ids (NaN at rows that are not 1:1).
    `chunks` is int32 [C, 6]: student positions [start, stop), teacher positions [start, stop)
    (in each side's whole sequence), response byte offsets [start, stop). `teacher_ids` is the
    teacher's sequence and `teacher_scores` its own answer over it (its rows, its ids).
    """

    request_id: str
    teacher: str
    model: str
    num_tokens: int
    first_row: int
    chunk_ids: torch.Tensor  # int32 [R]
    chunk_logprobs: torch.Tensor  # float32 [R]
    chunks: torch.Tensor  # int32 [C, 6]
    teacher_ids: torch.Tensor  # int32 [T']
    teacher_scores: TeacherScores
    topk_ids: torch.Tensor | None = None  # int32 [R, K]
    topk_logprobs: torch.Tensor | None = None  # float32 [R, K]
    unmapped_mass: torch.Tensor | None = None  # float32 [R]

    @property
    def num_rows(self) -> int:
        return self.num_tokens - self.first_row

    @property
    def student_spans(self) -> torch.Tensor:
        """int32 [C, 2]: each chunk's student positions [start, stop)."""
        return self.chunks[:, 0:2]

    @property
    def teacher_spans(self) -> torch.Tensor:
        """int32 [C, 2]: each chunk's teacher positions [start, stop) in `teacher_ids`."""
        return self.chunks[:, 2:4]

    @property
    def byte_spans(self) -> torch.Tensor:
        """int32 [C, 2]: each chunk's byte offsets [start, stop) in the response."""
        return self.chunks[:, 4:6]

    def one_to_one(self) -> torch.Tensor:
        """bool [R]: rows whose chunk is this one student token and one teacher token."""
        sizes = (self.chunks[:, 1] - self.chunks[:, 0] == 1) & (self.chunks[:, 3] - self.chunks[:, 2] == 1)
        return sizes[self.chunk_ids.long()]

    def chunk_starts(self) -> torch.Tensor:
        """bool [R]: rows that begin a chunk (their prefix is the same text on both sides)."""
        starts = torch.zeros(self.num_rows, dtype=torch.bool)
        starts[(self.chunks[:, 0] - self.first_row).long()] = True
        return starts

    def teacher_start_rows(self) -> torch.Tensor:
        """int64 [R]: for each row, the row of `teacher_scores` of its chunk's first teacher token."""
        first = (self.chunks[:, 2] - self.teacher_scores.first_row).long()
        return first[self.chunk_ids.long()]


def _tensor(message: scoring_pb2.Tensor) -> torch.Tensor:
    return decode_tensor(message).clone()  # owned: the caller may write to it


def aligned_from_response(response: scoring_pb2.ScoreResponse, teacher_scores: TeacherScores) -> AlignedScores:
    """An `AlignedScores` from a ScoreResponse carrying `aligned` (with the teacher's own answer,
    decoded by the caller)."""
    aligned = response.aligned
    optional = {name: _tensor(getattr(aligned, name)) for name in ("topk_ids", "topk_logprobs", "unmapped_mass")
                if aligned.HasField(name)}
    return AlignedScores(
        request_id=response.request_id, teacher=response.teacher, model=response.model,
        num_tokens=response.num_tokens, first_row=response.first_row,
        chunk_ids=_tensor(aligned.chunk_ids), chunk_logprobs=_tensor(aligned.chunk_logprobs),
        chunks=_tensor(aligned.chunks), teacher_ids=_tensor(aligned.teacher_ids), teacher_scores=teacher_scores,
        **optional)


@dataclass(frozen=True)
class AlignedBatch:
    """Aligned answers packed row after row (N rows), as the cross-tokenizer losses take them.

    `chunk_ids` are unique across the batch (each answer's offset by the chunks before it).
    `exact`: 1:1 rows, where `topk_ids` / `topk_logprobs` hold the teacher's top-k in student
    ids. `uld`: first rows of the other chunks, where `uld_teacher_logprobs` holds the teacher's
    top-k log-probs at the chunk's first teacher token (both sides predict the text after the
    same prefix there); -inf at every other row.
    """

    chunk_ids: torch.Tensor  # int64 [N]
    chunk_logprobs: torch.Tensor  # float32 [N]
    topk_ids: torch.Tensor  # int64 [N, K]
    topk_logprobs: torch.Tensor  # float32 [N, K]
    exact: torch.Tensor  # bool [N]
    uld: torch.Tensor  # bool [N]
    uld_teacher_logprobs: torch.Tensor  # float32 [N, K]


def _uld_rows(scores: AlignedScores) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = scores.teacher_scores.topk_logprobs
    uld = scores.chunk_starts() & ~scores.one_to_one()
    values = torch.full((scores.num_rows, teacher.shape[1]), float("-inf"))
    values[uld] = teacher[scores.teacher_start_rows()[uld]].float()
    return uld, values


def pack_aligned(answers: Sequence[AlignedScores]) -> AlignedBatch:
    """Several aligned answers (each asked with the same top-k K > 0) as one `AlignedBatch`."""
    if any(a.topk_ids is None for a in answers):
        raise ValueError("pack_aligned needs answers scored with topk > 0")
    offsets, chunk_ids = 0, []
    for answer in answers:
        chunk_ids.append(answer.chunk_ids.long() + offsets)
        offsets += answer.chunks.shape[0]
    uld = [_uld_rows(a) for a in answers]
    return AlignedBatch(
        chunk_ids=torch.cat(chunk_ids),
        chunk_logprobs=torch.cat([a.chunk_logprobs for a in answers]),
        topk_ids=torch.cat([a.topk_ids for a in answers]).long(),
        topk_logprobs=torch.cat([a.topk_logprobs for a in answers]),
        exact=torch.cat([a.one_to_one() for a in answers]),
        uld=torch.cat([u[0] for u in uld]),
        uld_teacher_logprobs=torch.cat([u[1] for u in uld]),
    )
