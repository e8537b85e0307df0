"""An aligned request (a student with another tokenizer) checked and turned into the teacher's.

The student's token ids must be ids of its tokenizer; `prompt_length` is read by the rule of
every request. The teacher's prompt is `teacher_prompt_ids` (ids of the teacher) or `messages`
rendered by the teacher tokenizer's chat template with the generation prompt: exactly one. The
response (the student's ids from prompt_length on) is decoded to its exact bytes and tokenized
by the teacher's tokenizer; with identical vocabularies the student's ids are the teacher's as
they are, so the answer is the plain request's. What comes out is an ordinary request over the
teacher's sequence (prompt_length = the teacher prompt's length), scored by the usual path,
and the chunks that map its rows back. Each check raises `invalid(field, ...)`.

Two steps, for a hostile caller: `check_sizes` holds the size rules that need no reading (the
student's ids, the teacher's prompt ids, the count of `messages`) by counting alone, in
microseconds, on the event loop before admission; then `plan_aligned`, admitted and off the loop,
checks the length of `messages` first (reading 30 MiB of text costs tens of milliseconds) and only
then does the work that grows with the request (rendering, tokenizing, mapping). Special tokens
come only from the teacher's template and the student's own special ids: `messages` holding a
teacher special token's text is refused (it would inject a role turn), and a student's plain
text "<|im_end|>" is tokenized as plain text, never as the teacher's special token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proctor.proto import scoring_pb2
from proctor.server.alignment.answer import AlignedAnswer, align_answer
from proctor.server.alignment.chunks import Chunks, chunk
from proctor.server.alignment.students import Pair
from proctor.server.common.errors import invalid
from proctor.server.engines.base import EngineInfo, EngineResult
from proctor.server.front.ids import extend_ids
from proctor.server.front.validation import response_first_row

# What an aligned request cannot ask for: its answer is in the student's rows, and these are not.
_NOT_ALIGNED = ("hidden_states", "score_ids", "images", "videos", "audios", "mm_processor_kwargs", "replica")


@dataclass(frozen=True)
class AlignedPlan:
    """An aligned request made ready: the teacher's request and how its rows map back."""

    teacher_request: scoring_pb2.ScoreRequest
    pair: Pair
    chunks: Chunks
    first_row: int  # the student's
    num_tokens: int  # the student's
    teacher_sequence: np.ndarray  # int64 [T']
    teacher_first_row: int

    def answer(self, result: EngineResult) -> AlignedAnswer:
        """The teacher's scored rows mapped to the student's."""
        topk = None
        if self.teacher_request.topk:
            topk = (result.topk_ids, result.topk_logprobs)
        return align_answer(self.chunks, first_row=self.first_row, teacher_sequence=self.teacher_sequence,
                            teacher_first_row=self.teacher_first_row, teacher_logprobs=result.logprobs,
                            teacher_topk=topk, vocab_map=self.pair.vocab_map)


def _refuse_unaligned_outputs(request: scoring_pb2.ScoreRequest) -> None:
    for name in _NOT_ALIGNED:
        field = getattr(request, name)
        if (request.HasField(name) if name == "score_ids" else bool(field)):
            why = ("a pinned replica is not served with student_tokenizer (an aligned request is routed as the "
                   "teacher's request it becomes)" if name == "replica" else
                   "is not served with student_tokenizer: an aligned answer is in the student's rows "
                   "(chunk log-likelihoods and top-k), which these are not")
            raise invalid(name, why)


def check_sizes(request: scoring_pb2.ScoreRequest, info: EngineInfo, teacher: str) -> int:
    """The size rules that count without reading (no copy, no rendering, no tokenizing): the tokens
    the request may cost, for admission (with `messages`, all the teacher scores: their length is
    read off the loop, by `check_message_length`)."""
    _refuse_unaligned_outputs(request)
    limit = info.max_sequence_tokens
    for name in ("token_ids", "teacher_prompt_ids"):
        count = len(getattr(request, name))
        if count > limit:
            raise invalid(name, f"has {count} tokens, more than teacher {teacher!r} scores ({limit})")
    if len(request.messages) > limit:
        raise invalid("messages", f"has {len(request.messages)} messages, more than teacher {teacher!r} scores "
                      f"tokens ({limit})")
    return limit if request.messages else len(request.token_ids) + len(request.teacher_prompt_ids)


def check_message_length(request: scoring_pb2.ScoreRequest, pair: Pair, info: EngineInfo, teacher: str) -> None:
    """A text of C characters is at least C bytes, so it renders to at least C / (the teacher's
    longest token in bytes) tokens: past `max_sequence_tokens` of those it cannot fit, and is
    refused before anything renders or tokenizes it."""
    limit = info.max_sequence_tokens
    chars = sum(len(m.role) + len(m.content) for m in request.messages)
    most = limit * max(1, int(pair.teacher.table.lengths.max()))
    if chars > most:
        raise invalid("messages", f"hold {chars} characters; teacher {teacher!r} scores {limit} tokens of at most "
                      f"{most // limit} bytes each, so at most {most} characters fit")


def _student_ids(request: scoring_pb2.ScoreRequest, pair: Pair) -> np.ndarray:
    ids = np.asarray(request.token_ids, dtype=np.int64)
    if len(ids) < 2:
        raise invalid("token_ids", f"has {len(ids)} tokens; send the student's prompt and response ids (at least 2)")
    table = pair.student.table
    bad = (ids < 0) | (ids >= table.size)
    bad[~bad] = table.lengths[ids[~bad]] == 0
    if bad.any():
        position = int(np.flatnonzero(bad)[0])
        raise invalid("token_ids", f"token {int(ids[position])} at position {position} is not an id of student "
                      f"tokenizer {pair.student.key!r} (its ids: 0..{table.size - 1})")
    return ids


def _teacher_prompt(request: scoring_pb2.ScoreRequest, pair: Pair, info: EngineInfo, teacher: str) -> np.ndarray:
    if request.teacher_prompt_ids and request.messages:
        raise invalid("teacher_prompt_ids", "give the teacher's prompt once: teacher_prompt_ids or messages, not both")
    if request.teacher_prompt_ids:
        ids = np.asarray(request.teacher_prompt_ids, dtype=np.int64)
        outside = (ids < 0) | (ids >= info.vocab_size)
        if outside.any():
            position = int(np.flatnonzero(outside)[0])
            raise invalid("teacher_prompt_ids", f"token {int(ids[position])} at position {position} is outside "
                          f"[0, {info.vocab_size}) (teacher {teacher!r})")
        return ids
    if not request.messages:
        raise invalid("teacher_prompt_ids", "an aligned request (student_tokenizer) needs the teacher's prompt: "
                      "teacher_prompt_ids, or messages for the teacher's chat template")
    return _rendered(request, pair, teacher)


def _rendered(request: scoring_pb2.ScoreRequest, pair: Pair, teacher: str) -> np.ndarray:
    """`messages` rendered by the teacher's chat template (with the generation prompt), as ids."""
    tokenizer = pair.teacher.tokenizer
    if not pair.teacher.chat_template:
        raise invalid("messages", f"teacher {teacher!r}'s tokenizer has no chat template; send teacher_prompt_ids")
    specials = pair.teacher.specials
    for index, message in enumerate(request.messages):
        for name in ("role", "content"):
            found = specials.search(getattr(message, name)) if specials is not None else None
            if found:
                raise invalid(f"messages[{index}].{name}", f"holds {found.group()!r}, a special token of teacher "
                              f"{teacher!r}: only its chat template places those (a turn of another role)")
    conversation = [{"role": m.role, "content": m.content} for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own refusal (raise_exception), or a template error
        raise invalid("messages", f"teacher {teacher!r}'s chat template cannot render them: {exc}") from None
    ids = np.asarray(pair.teacher.table.encode_text(text), dtype=np.int64)
    if not len(ids):
        raise invalid("messages", f"teacher {teacher!r}'s chat template renders them as no tokens")
    return ids


def _teacher_response(response: np.ndarray, pair: Pair) -> np.ndarray:
    """The response as the teacher's ids: each run of the student's plain tokens tokenized as
    plain text (special-token text split), each run of its special ids with specials recognised."""
    if pair.identical:  # the same vocabulary: the teacher scores the student's own tokens
        return response
    special = pair.student.table.special[response]
    cuts = np.flatnonzero(special[1:] != special[:-1]) + 1
    parts = []
    for run, flags in zip(np.split(response, cuts), np.split(special, cuts), strict=True):
        data = pair.student.table.decode(run)
        try:
            parts.append(pair.teacher.table.encode(data, specials=bool(flags[0])))
        except ValueError as exc:
            raise invalid("token_ids", f"the teacher's tokenizer cannot tokenize the response's bytes exactly: "
                          f"{exc}") from None
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if (pair.teacher.table.lengths[ids] == 0).any():  # a token of no bytes has no place in a chunk
        raise invalid("token_ids", "the teacher's tokenizer makes a token of no bytes from the response")
    return ids


def plan_aligned(request: scoring_pb2.ScoreRequest, pair: Pair, info: EngineInfo, teacher: str) -> AlignedPlan:
    """The teacher's request for an aligned one, and its chunks (the work grows with the request:
    run it admitted and off the event loop, after `check_sizes`)."""
    check_message_length(request, pair, info, teacher)
    ids = _student_ids(request, pair)
    first_row = response_first_row(request, len(ids))
    prompt = _teacher_prompt(request, pair, info, teacher)
    response = ids[first_row:]
    teacher_response = _teacher_response(response, pair)
    sequence = np.concatenate([prompt, teacher_response])
    if len(sequence) > info.max_sequence_tokens:
        raise invalid("token_ids", f"the teacher's prompt and its tokenization of the response are {len(sequence)} "
                      f"tokens, more than teacher {teacher!r} scores ({info.max_sequence_tokens})")
    chunks = chunk(pair.student.table.lengths[response], pair.teacher.table.lengths[teacher_response])
    message = scoring_pb2.ScoreRequest(request_id=request.request_id, teacher_key=request.teacher_key,
                                       prompt_length=len(prompt), logprobs=True, topk=request.topk,
                                       cache_salt=request.cache_salt)
    if request.HasField("temperature"):
        message.temperature = request.temperature
    extend_ids(message.token_ids, sequence.tolist())
    return AlignedPlan(message, pair, chunks, first_row, len(ids), sequence, len(prompt))
