"""The service's path for aligned requests: a student with another tokenizer.

An aligned request is routed as any other (its `teacher_key`), checked and turned into the
teacher's request (`aligned_request.plan_aligned`), scored through the service's own path
(validation, admission, routing, failover, metrics), and its answer mapped to the student's
rows (`ScoredRequest.aligned`). Its sizes are checked by counting before anything else
(`check_sizes`); then it is admitted, and only then does the work that grows with it (rendering,
decoding, tokenizing, mapping) run, in a worker thread once the request is large, so the event
loop keeps serving.
The student tokenizers and every pair's map are loaded once, at start (`load`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from proctor.proto import scoring_pb2
from proctor.server.alignment.students import StudentTokenizers, Unalignable
from proctor.server.common.errors import Code, ScoringError, invalid
from proctor.server.common.off_loop import off_loop_if
from proctor.server.front.aligned_request import check_sizes, plan_aligned
from proctor.server.front.validation import request_mode

if TYPE_CHECKING:
    from proctor.server.front.fleet.routing import ReplicaSet
    from proctor.server.front.service import ScoredRequest, ScoringService

log = logging.getLogger(__name__)

# Student tokens past which an aligned request's decoding, tokenizing and mapping leave the loop.
ALIGN_INLINE_TOKENS = 1024


class AlignedScoring:
    """The student tokenizers of one service, and the aligned requests scored with them."""

    def __init__(self, student_tokenizers: Mapping[str, str] | None = None) -> None:
        self.tokenizers = StudentTokenizers(student_tokenizers)

    async def load(self, teacher_sets: Iterable[ReplicaSet]) -> None:
        """Read the student tokenizers and the teachers', build every pair's map (in a thread)."""
        dirs = {teacher_set.name: teacher_set.tokenizer_path for teacher_set in teacher_sets}
        await asyncio.to_thread(self.tokenizers.load, dirs)

    async def score(self, service: ScoringService, request: scoring_pb2.ScoreRequest, *, timeout: float | None,
                    unary: bool) -> ScoredRequest:
        """One aligned request end to end; ScoringError as any request's."""
        mode = request_mode(request)
        teacher_set = service.route(request)
        large = len(request.token_ids) > ALIGN_INLINE_TOKENS or bool(request.messages)
        try:
            service.check_serving()
            try:
                pair = self.tokenizers.pair(request.student_tokenizer, teacher_set.name)
            except Unalignable as exc:
                raise invalid("student_tokenizer", str(exc)) from None
            tokens = check_sizes(request, teacher_set.info, teacher_set.name)
            admission = service.admit(teacher_set, tokens)
        except ScoringError as exc:
            service.metrics.request_done(teacher_set.name, mode, exc.code.name.lower())
            raise
        try:
            try:
                plan = await off_loop_if(large, plan_aligned, request, pair, teacher_set.info, teacher_set.name)
            except ScoringError as exc:
                service.metrics.request_done(teacher_set.name, mode, exc.code.name.lower())
                raise
            scored = await service.score_teacher(plan.teacher_request, timeout=timeout, unary=unary, mode=mode,
                                                 admitted=True)
        finally:
            service.release(admission, tokens)
        try:
            answer = await off_loop_if(large, plan.answer, scored.result)
        except Exception as exc:  # a fault of the mapping, not of the request: say so, never a wrong answer
            log.exception("aligning the teacher's answer failed")
            raise ScoringError(Code.INTERNAL, f"aligning the teacher's answer failed: {exc}") from exc
        return replace(scored, num_tokens=plan.num_tokens, aligned=answer)

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
