"""The student tokenizers a server aligns to, and each teacher's side of every pair, loaded at start.

`server.student_tokenizers: {KEY: DIR}` (or `proctor serve --student-tokenizer KEY=DIR`) names
them. At start, before a replica loads, each is read and turned into its byte table; a student
tokenizer that cannot be read or is not byte-level stops the server (`StudentTokenizerError`):
it was asked for by name, so serving without it would fail every request that names it. Each
teacher's tokenizer (its model directory's) is read too, and for every (student, teacher) pair
the exact-match vocabulary map is built once. A teacher whose tokenizer is missing or not
byte-level still serves plain requests; its aligned requests are refused with the reason.
Nothing here is loaded or built inside a request.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from proctor.server.alignment.token_bytes import NotByteLevel, TokenBytes
from proctor.server.alignment.vocab_map import exact_match_map, identical
from proctor.server.engines.fingerprint import model_fingerprint

log = logging.getLogger(__name__)


class StudentTokenizerError(RuntimeError):
    """A configured student tokenizer cannot be served (the server does not start)."""


class Unalignable(LookupError):
    """An aligned request names a student tokenizer, or a teacher, that has no pair; the
    message says why."""


def load_tokenizer(path: str | Path) -> Any:
    """A transformers tokenizer from a local directory (public API only; nothing downloaded)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@dataclass(frozen=True)
class StudentTokenizer:
    key: str
    table: TokenBytes
    fingerprint: str


@dataclass(frozen=True)
class TeacherTokenizer:
    """A teacher's tokenizer: its byte table, and the tokenizer itself for its chat template."""

    tokenizer: Any
    table: TokenBytes
    specials: re.Pattern[str] | None = None  # any of its special tokens' text (None: it has none)

    @property
    def chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


@dataclass(frozen=True)
class Pair:
    """A (student tokenizer, teacher) pair: both tables and the exact-match map of teacher ids."""

    student: StudentTokenizer
    teacher: TeacherTokenizer
    vocab_map: np.ndarray  # int64 [V_teacher tokenizer]: student id or -1
    identical: bool

    @property
    def exact_matches(self) -> int:
        return int((self.vocab_map >= 0).sum())


def _student(key: str, path: str) -> StudentTokenizer:
    where = f"student tokenizer {key!r} ({path})"
    if not Path(path).is_dir():
        raise StudentTokenizerError(f"{where}: not a directory here")
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:
        raise StudentTokenizerError(f"{where}: transformers cannot read it ({exc})") from exc
    try:
        table = TokenBytes.of(tokenizer)
    except NotByteLevel as exc:
        raise StudentTokenizerError(f"{where}: {exc}; only byte-level tokenizers are aligned") from exc
    return StudentTokenizer(key, table, model_fingerprint(path))


def _teacher(name: str, path: str | None) -> TeacherTokenizer | str:
    """The teacher's tokenizer, or why its scores cannot be aligned."""
    if not path or not Path(path).is_dir():
        return f"teacher {name!r} has no tokenizer directory here"
    try:
        tokenizer = load_tokenizer(path)
        table = TokenBytes.of(tokenizer)
        texts = table.special_texts()
        return TeacherTokenizer(tokenizer, table, re.compile("|".join(map(re.escape, texts))) if texts else None)
    except NotByteLevel as exc:
        return f"teacher {name!r}'s tokenizer: {exc}"
    except Exception as exc:
        return f"teacher {name!r}'s tokenizer cannot be read ({exc})"


class StudentTokenizers:
    """Every configured student tokenizer and every (student, teacher) pair, built by `load`."""

    def __init__(self, dirs: Mapping[str, str] | None = None) -> None:
        self.dirs = dict(dirs or {})
        self.students: dict[str, StudentTokenizer] = {}
        self.teachers: dict[str, TeacherTokenizer] = {}
        self._why_not: dict[str, str] = {}  # teacher name -> why it has no pairs
        self._pairs: dict[tuple[str, str], Pair] = {}

    def load(self, teacher_dirs: Mapping[str, str | None]) -> None:
        """Read the student tokenizers and the teachers' (name -> model directory), build each
        pair's map. Blocking: the server runs it in a thread at start."""
        if not self.dirs:
            return
        self.students = {key: _student(key, path) for key, path in self.dirs.items()}
        for name, path in teacher_dirs.items():
            teacher = _teacher(name, path)
            if isinstance(teacher, str):
                log.warning("aligned requests to teacher %r are refused: %s", name, teacher)
                self._why_not[name] = teacher
                continue
            self.teachers[name] = teacher
            for key, student in self.students.items():
                pair = Pair(student, teacher, exact_match_map(teacher.table, student.table),
                            identical(teacher.table, student.table))
                self._pairs[key, name] = pair
                log.info("student tokenizer %r -> teacher %r: %d exact matches%s", key, name, pair.exact_matches,
                         " (identical vocabularies)" if pair.identical else "")

    def pair(self, student_key: str, teacher: str) -> Pair:
        """The pair an aligned request needs; Unalignable says why there is none."""
        if student_key not in self.students:
            known = ", ".join(sorted(self.students)) or "none (server.student_tokenizers, --student-tokenizer)"
            raise Unalignable(f"is {student_key!r}, not a student tokenizer of this server (it has: {known})")
        pair = self._pairs.get((student_key, teacher))
        if pair is None:
            raise Unalignable(f"teacher {teacher!r} cannot be aligned: {self._why_not.get(teacher, 'not loaded')}")
        return pair

    def pairs_of(self, teacher: str) -> list[Pair]:
        return [pair for (_, name), pair in self._pairs.items() if name == teacher]
