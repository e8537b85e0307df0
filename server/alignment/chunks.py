"""The response cut into chunks at the byte offsets where both tokenizations end a token.

Two tokenizations of the same bytes agree on some token boundaries and not on others. The
boundaries they share cut the response into chunks such that each chunk is a whole number of
student tokens and a whole number of teacher tokens (at least one of each: a chunk's last byte
ends a token on both sides), and the chunks cover the response once, in order. A chunk of one
student token and one teacher token is the same text on both sides: a 1:1 position, where the
two distributions can be compared id by id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Chunks:
    """The chunks of one response: which chunk each token is in, and each chunk's spans.

    Positions are token indexes within the response (0 = its first token) on each side;
    `byte_stops[c]` is the offset where chunk c ends (it starts where chunk c - 1 ends).
    """

    student_chunk: np.ndarray  # int64 [Ns]: each student token's chunk
    teacher_chunk: np.ndarray  # int64 [Nt]: each teacher token's chunk
    student_stops: np.ndarray  # int64 [C]: chunk c holds student tokens student_stops[c-1]..student_stops[c]-1
    teacher_stops: np.ndarray  # int64 [C]: likewise for teacher tokens
    byte_stops: np.ndarray  # int64 [C]

    @property
    def count(self) -> int:
        return len(self.byte_stops)

    @staticmethod
    def starts(stops: np.ndarray) -> np.ndarray:
        """Each chunk's first index, from the stops."""
        return np.concatenate([[0], stops[:-1]]).astype(np.int64)

    def one_to_one(self) -> np.ndarray:
        """bool [C]: the chunks of one student token and one teacher token."""
        student = np.diff(self.student_stops, prepend=0)
        teacher = np.diff(self.teacher_stops, prepend=0)
        return (student == 1) & (teacher == 1)


def chunk(student_lengths: np.ndarray, teacher_lengths: np.ndarray) -> Chunks:
    """Chunks of a response from each side's token byte lengths (every length >= 1, equal sums)."""
    student_ends = np.cumsum(student_lengths)
    teacher_ends = np.cumsum(teacher_lengths)
    if student_ends[-1] != teacher_ends[-1]:
        raise ValueError(f"the tokenizations cover {student_ends[-1]} and {teacher_ends[-1]} bytes")
    shared = np.intersect1d(student_ends, teacher_ends, assume_unique=True)
    # A token is in the chunk of the first shared boundary at or after its end.
    student_chunk = np.searchsorted(shared, student_ends, side="left")
    teacher_chunk = np.searchsorted(shared, teacher_ends, side="left")
    count = len(shared)
    return Chunks(
        student_chunk=student_chunk,
        teacher_chunk=teacher_chunk,
        student_stops=np.cumsum(np.bincount(student_chunk, minlength=count)),
        teacher_stops=np.cumsum(np.bincount(teacher_chunk, minlength=count)),
        byte_stops=shared.astype(np.int64),
    )
