"""The exact-match vocabulary map of a (student, teacher) pair, built once at start.

A teacher id maps to the student id whose decoded bytes are the same (special tokens only to
special tokens, ordinary ones only to ordinary ones: a student's text "<|im_end|>" is not its
end-of-turn token). A teacher top-k at a 1:1 position is answered in student ids through it;
teacher ids without a match are reported as unmapped, never guessed.
"""

from __future__ import annotations

import numpy as np

from proctor.server.alignment.token_bytes import TokenBytes


def exact_match_map(teacher: TokenBytes, student: TokenBytes) -> np.ndarray:
    """int64 [V_teacher]: for each teacher id the student id of the same bytes, -1 where none.
    Among student ids of equal bytes the lowest is taken (ids with no bytes never match)."""
    by_bytes: dict[tuple[bool, bytes], int] = {}
    for index, piece in enumerate(student.pieces):
        if piece:
            by_bytes.setdefault((bool(student.special[index]), piece), index)
    return np.fromiter(
        (by_bytes.get((bool(teacher.special[index]), piece), -1) if piece else -1
         for index, piece in enumerate(teacher.pieces)),
        dtype=np.int64, count=teacher.size)


def identical(teacher: TokenBytes, student: TokenBytes) -> bool:
    """Whether both vocabularies decode every id to the same bytes (and agree on which are
    special): then the student's ids are the teacher's, and no re-tokenizing is needed."""
    return teacher.pieces == student.pieces and bool(np.array_equal(teacher.special, student.special))
