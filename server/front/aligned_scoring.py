"""The student tokenizers of one service, and the steps of an aligned request (a student with
another tokenizer) that are not the teacher's scoring.

The service drives an aligned request (`ScoringService.score`, routed once like any request):
`check` holds the size rules that need no reading, by counting, before admission; once admitted,
`plan` turns it into the teacher's request (`aligned_request.plan_aligned`), which the service
scores by its own path (validation, replicas, failover, metrics); `answer` maps the teacher's rows
to the student's (`ScoredRequest.aligned`). The work that grows with a request (rendering,
decoding, tokenizing, mapping) runs in a worker thread once the request is large, so the event
loop keeps serving. Nothing here calls the service: it holds no reference to it.
The student tokenizers and every pair's map are loaded once, at start (`load`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proctor.proto import scoring_pb2
from proctor.server.alignment.answer import AlignedAnswer
from proctor.server.alignment.students import Pair, StudentTokenizers, Unalignable
from proctor.server.common.errors import Code, ScoringError, invalid
from proctor.server.common.off_loop import off_loop_if
from proctor.server.engines.base import EngineResult
from proctor.server.front.aligned_request import AlignedPlan, check_sizes, plan_aligned

if TYPE_CHECKING:
    from proctor.server.front.fleet.routing import ReplicaSet

log = logging.getLogger(__name__)

# Student tokens past which an aligned request's decoding, tokenizing and mapping leave the loop.
ALIGN_INLINE_TOKENS = 1024


@dataclass(frozen=True)
class AlignedAsk:
    """An aligned request whose sizes passed: its tokenizer pair and the tokens it is admitted for."""

    request: scoring_pb2.ScoreRequest
    teacher_set: ReplicaSet
    pair: Pair
    tokens: int

    @property
    def large(self) -> bool:
        """Whether its planning and mapping run in a worker thread."""
        return len(self.request.token_ids) > ALIGN_INLINE_TOKENS or bool(self.request.messages)


class AlignedScoring:
    """The student tokenizers of one service, and the aligned requests' checking, planning and mapping."""

    def __init__(self, student_tokenizers: Mapping[str, str] | None = None) -> None:
        self.tokenizers = StudentTokenizers(student_tokenizers)

    async def load(self, teacher_sets: Iterable[ReplicaSet]) -> None:
        """Read the student tokenizers and the teachers', build every pair's map (in a thread)."""
        dirs = {teacher_set.name: teacher_set.tokenizer_path for teacher_set in teacher_sets}
        await asyncio.to_thread(self.tokenizers.load, dirs)

    def check(self, request: scoring_pb2.ScoreRequest, teacher_set: ReplicaSet) -> AlignedAsk:
        """The pair and the size rules, by counting alone (before admission); ScoringError names the field."""
        try:
            pair = self.tokenizers.pair(request.student_tokenizer, teacher_set.name)
        except Unalignable as exc:
            raise invalid("student_tokenizer", str(exc)) from None
        return AlignedAsk(request, teacher_set, pair, check_sizes(request, teacher_set.info, teacher_set.name))

    async def plan(self, ask: AlignedAsk) -> AlignedPlan:
        """The teacher's request and the chunks that map its rows back (admitted: it reads the request)."""
        info = ask.teacher_set.info
        return await off_loop_if(ask.large, plan_aligned, ask.request, ask.pair, info, ask.teacher_set.name)

    async def answer(self, ask: AlignedAsk, plan: AlignedPlan, result: EngineResult) -> AlignedAnswer:
        """The teacher's rows mapped to the student's; a fault of the mapping is INTERNAL, never a wrong answer."""
        try:
            return await off_loop_if(ask.large, plan.answer, result)
        except Exception as exc:
            log.exception("aligning the teacher's answer failed")
            raise ScoringError(Code.INTERNAL, f"aligning the teacher's answer failed: {exc}") from exc

    def vocabularies(self, teacher: str) -> list[scoring_pb2.AlignedVocabulary]:
        """The teacher's pairs as ListTeachers lists them."""
        return [scoring_pb2.AlignedVocabulary(student_tokenizer=pair.student.key, exact_matches=pair.exact_matches,
                                              identical=pair.identical) for pair in self.tokenizers.pairs_of(teacher)]

    def chat_template(self, teacher: str) -> bool:
        side = self.tokenizers.teachers.get(teacher)
        return side is not None and side.chat_template

    def student_infos(self) -> list[scoring_pb2.StudentTokenizerInfo]:
        """The loaded student tokenizers as ListTeachers lists them."""
        return [scoring_pb2.StudentTokenizerInfo(key=s.key, vocab_size=s.table.size, fingerprint=s.fingerprint)
                for s in self.tokenizers.students.values()]
