"""A scored teacher sequence mapped to the student's rows: what an aligned request answers.

Per student token (rows first_row..T-1 of the student's sequence): its chunk, the chunk's
teacher log-likelihood (the sum of the teacher's token log-probs over the chunk, in float64,
the same value for every student token of the chunk), and at 1:1 positions the teacher's top-k
in student ids through the pair's exact-match map (-1 and -inf elsewhere), with the top-k mass
that found no student id (NaN at rows that are not 1:1). Beside them the alignment itself (each chunk's student and teacher
positions and byte offsets) and the teacher's own sequence, so a trainer can run GOLD/ULD on
the teacher's rows too. Everything here is array work over the rows (no Python per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from proctor.proto import encode_tensor, scoring_pb2
from proctor.server.alignment.chunks import Chunks


@dataclass(frozen=True)
class AlignedAnswer:
    """The student-row outputs of one aligned request (tensors over numpy buffers)."""

    first_row: int  # the student's
    teacher_num_tokens: int
    chunk_ids: torch.Tensor  # int32 [R]
    chunk_logprobs: torch.Tensor  # float32 [R]
    topk_ids: torch.Tensor | None  # int32 [R, K], student ids, -1 where none
    topk_logprobs: torch.Tensor | None  # float32 [R, K], -inf where topk_ids is -1
    unmapped_mass: torch.Tensor | None  # float32 [R], NaN where the row is not 1:1
    chunks: torch.Tensor  # int32 [C, 6]
    teacher_ids: torch.Tensor  # int32 [T']

    def rows(self) -> list[tuple[str, torch.Tensor]]:
        """The outputs of one row per student token, by their `AlignedScores` field names."""
        named = [("chunk_ids", self.chunk_ids), ("chunk_logprobs", self.chunk_logprobs),
                 ("topk_ids", self.topk_ids), ("topk_logprobs", self.topk_logprobs),
                 ("unmapped_mass", self.unmapped_mass)]
        return [(name, value) for name, value in named if value is not None]

    def protobuf(self) -> bytes:
        """The serialised `AlignedScores` fields, all but `teacher` (the front splices the
        teacher's own answer in after them)."""
        fields = {name: encode_tensor(value, first_row=self.first_row) for name, value in self.rows()}
        return scoring_pb2.AlignedScores(chunks=encode_tensor(self.chunks), teacher_ids=encode_tensor(self.teacher_ids),
                                         **fields).SerializeToString()


def _topk(chunks: Chunks, vocab_map: np.ndarray, teacher_ids: np.ndarray, teacher_logprobs: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Student-row top-k (ids, log-probs) and unmapped mass from the teacher's top-k rows."""
    rows, k = len(chunks.student_chunk), teacher_ids.shape[1]
    ids = np.full((rows, k), -1, dtype=np.int32)
    logprobs = np.full((rows, k), -np.inf, dtype=np.float32)
    single = chunks.one_to_one()
    student_rows = chunks.student_stops[single] - 1  # each 1:1 chunk's one student token
    teacher_rows = chunks.teacher_stops[single] - 1  # and its one teacher token
    # A model may have more rows than its tokenizer has ids: those (and only those) read the -1 past the map.
    extended = np.append(vocab_map.astype(np.int32), np.int32(-1))
    mapped = extended[np.minimum(teacher_ids[teacher_rows], len(vocab_map))]
    found = mapped >= 0
    top = teacher_logprobs[teacher_rows]
    ids[student_rows] = mapped
    logprobs[student_rows] = np.where(found, top, np.float32(-np.inf))
    # At a 1:1 row, the mass of the teacher ids without a student id; elsewhere undefined (NaN).
    mass = np.full(rows, np.nan, dtype=np.float32)
    mass[student_rows] = (np.exp(top) * ~found).sum(axis=1)
    return ids, logprobs, mass


def align_answer(chunks: Chunks, *, first_row: int, teacher_sequence: np.ndarray, teacher_first_row: int,
                 teacher_logprobs: torch.Tensor, teacher_topk: tuple[torch.Tensor, torch.Tensor] | None,
                 vocab_map: np.ndarray) -> AlignedAnswer:
    """The student-row answer from the teacher's rows teacher_first_row..T'-1 (one per teacher
    response token): log-probs [Nt] and, when asked, its top-k (ids [Nt, K], log-probs [Nt, K])."""
    logprobs = teacher_logprobs.numpy().astype(np.float64)
    chunk_sums = np.bincount(chunks.teacher_chunk, weights=logprobs, minlength=chunks.count)
    topk = None
    if teacher_topk is not None:
        topk = _topk(chunks, vocab_map, teacher_topk[0].numpy(), teacher_topk[1].numpy())
    spans = np.stack([
        first_row + Chunks.starts(chunks.student_stops), first_row + chunks.student_stops,
        teacher_first_row + Chunks.starts(chunks.teacher_stops), teacher_first_row + chunks.teacher_stops,
        Chunks.starts(chunks.byte_stops), chunks.byte_stops,
    ], axis=1).astype(np.int32)
    return AlignedAnswer(
        first_row=first_row,
        teacher_num_tokens=len(teacher_sequence),
        chunk_ids=torch.from_numpy(chunks.student_chunk.astype(np.int32)),
        chunk_logprobs=torch.from_numpy(chunk_sums[chunks.student_chunk].astype(np.float32)),
        topk_ids=None if topk is None else torch.from_numpy(topk[0]),
        topk_logprobs=None if topk is None else torch.from_numpy(topk[1]),
        unmapped_mass=None if topk is None else torch.from_numpy(topk[2]),
        chunks=torch.from_numpy(spans),
        teacher_ids=torch.from_numpy(teacher_sequence.astype(np.int32)),
    )
