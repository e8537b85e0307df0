"""A `ScoreRequest` off the wire → one validated request, checked once for both transports.

`validate` checks every field against what the teacher the request was routed to serves (its
real limits: vLLM keeps one `max_model_len` slot for the prefill's output token), checks that a
unary answer fits one message, and builds the `EngineRequest` with the ids in the one array form
every engine takes (numpy int32: `engines.base`). Media are decoded afterwards, off the event
loop (`decode`), still before admission.
Each check raises `invalid(field, ...)`: INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, replace

import numpy as np
import torch

from proctor.proto import scoring_pb2
from proctor.proto.hidden_forms import row_bytes
from proctor.server.common.errors import Code, ScoringError, invalid
from proctor.server.engines.base import EngineInfo, EngineRequest, EngineResult, MediaItem, MultiModalInputs
from proctor.server.engines.media import MediaLimits, decode_media
from proctor.server.engines.teacher_serves import (
    Problem,
    media_problem,
    outputs_problem,
    score_ids_problem,
    sequence_problem,
)
from proctor.server.engines.token_ids import token_array
from proctor.server.front.fleet.routing import ReplicaSet
from proctor.server.front.media_fields import media_item, processor_kwargs
from proctor.server.worker.wire import EncodedResult, nonfinite_outputs

# Scores are computed in float32 by every engine (`engines.row_scores`): a temperature must be a
# normal float32 number, and the scores it gives must be finite (`check_finite`).
SCORES_FINFO = torch.finfo(torch.float32)


@dataclass(frozen=True)
class ValidRequest:
    """A request every check has passed: the teacher that scores it and what to score."""

    teacher_set: ReplicaSet
    request: EngineRequest
    mode: str  # metrics label: what was asked for, e.g. "logprobs+topk"
    replica: str | None = None  # the replica the request is pinned to (`ScoreRequest.replica`)


def request_mode(request: scoring_pb2.ScoreRequest) -> str:
    """A metrics label naming what was asked for, e.g. "logprobs+topk"."""
    parts = [name for name, on in (("logprobs", request.logprobs), ("topk", request.topk > 0),
                                   ("hidden_states", request.hidden_states),
                                   ("score_ids", request.HasField("score_ids")),
                                   ("aligned", bool(request.student_tokenizer))) if on]
    return "+".join(parts) or "none"


def validate(teacher_set: ReplicaSet, request: scoring_pb2.ScoreRequest, *, max_answer_bytes: int | None,
             ranks: bool = False) -> ValidRequest:
    """Check a request once against the teacher it was routed to; `max_answer_bytes` bounds a
    unary answer (None: a streamed one); `ranks` asks the actual tokens' ranks beside log-probs."""
    info = teacher_set.info
    ids = _token_ids(request, info, teacher_set.name)
    first_row = response_first_row(request, len(ids))
    _check_outputs(request, info, teacher_set.name)
    score_ids = _score_ids(request, info, teacher_set.name, first_row, len(ids))
    if max_answer_bytes is not None and request.hidden_states:
        size = (len(ids) - first_row) * row_bytes(request.hidden_form, info.hidden_size, info.projection_rank, 4)
        if size > max_answer_bytes:
            raise invalid("hidden_states", f"about {size >> 20} MiB of hidden states do not fit one message; "
                          "stream them (gRPC ScoreStream, HTTP /v1/score/stream)")
    media = _media_inputs(request, info, teacher_set.name)
    engine_request = EngineRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        token_ids=ids,
        first_row=first_row,
        logprobs=request.logprobs,
        topk=request.topk,
        hidden_states=request.hidden_states,
        temperature=_temperature(request, info, teacher_set.name),
        media=media if media else None,
        score_ids=score_ids,
        cache_salt=request.cache_salt,
        hidden_form=request.hidden_form,
        ranks=ranks,
    )
    return ValidRequest(teacher_set, engine_request, request_mode(request), _replica(request, teacher_set))


async def decode(valid: ValidRequest, limits: MediaLimits) -> ValidRequest:
    """The request with its media decoded and bounded, off the event loop: a bad item is this
    request's INVALID_ARGUMENT and never reaches a replica."""
    if not valid.request.media:
        return valid
    try:
        media = await asyncio.to_thread(decode_media, valid.request.media, limits)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0].split("[", 1)[0] or "images"
        raise ScoringError(Code.INVALID_ARGUMENT, str(exc), field=field) from None
    return replace(valid, request=replace(valid.request, media=media))


def _token_ids(request: scoring_pb2.ScoreRequest, info: EngineInfo, teacher: str) -> np.ndarray:
    count = len(request.token_ids)
    _raise(sequence_problem(info, teacher, count))  # before any copy of a huge list
    if count == 0:
        raise invalid("token_ids", "is empty; send the prompt and response token ids")
    if count < 2:
        raise invalid("token_ids", "needs at least 2 tokens (row 0 has no prefix to score)")
    # numpy, not torch: torch calls on the event loop can stall behind an engine's thread.
    ids = token_array(request.token_ids)  # the one form, carried as it is to the engine
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= info.vocab_size:
        bad = low if low < 0 else high
        position = int(np.flatnonzero(ids == bad)[0])
        raise invalid("token_ids", f"token {bad} at position {position} is outside [0, {info.vocab_size})")
    return ids


def _raise(problem: Problem) -> None:
    """A `teacher_serves` rule's finding as this request's INVALID_ARGUMENT."""
    if problem is not None:
        raise invalid(*problem)


def response_first_row(request: scoring_pb2.ScoreRequest, count: int) -> int:
    """The first row answered: prompt_length when given (in [1, count - 1]), else 1."""
    if not request.HasField("prompt_length"):
        return 1
    first_row = request.prompt_length
    if not 1 <= first_row < count:
        raise invalid("prompt_length", f"is {first_row}; it must be in [1, {count - 1}] for {count} tokens")
    return first_row


def _check_outputs(request: scoring_pb2.ScoreRequest, info: EngineInfo, teacher: str) -> None:
    if request.topk < 0:
        raise invalid("topk", f"is {request.topk}; it must be >= 0")
    if not (request.logprobs or request.topk or request.hidden_states or request.HasField("score_ids")):
        raise invalid("logprobs", "nothing asked for: set logprobs, topk > 0, hidden_states or score_ids")
    _raise(outputs_problem(info, teacher, topk=request.topk, hidden_states=request.hidden_states,
                           hidden_form=request.hidden_form))


def _score_ids(
    request: scoring_pb2.ScoreRequest, info: EngineInfo, teacher: str, first_row: int, count: int
) -> np.ndarray | None:
    """The request's score_ids as int32 [R, K] (-1 padding), a view of the message's bytes (the one
    form, uncopied), every row, id and size checked here: an engine never sees an id it could index
    out of range."""
    if not request.HasField("score_ids"):
        return None
    wire = request.score_ids
    _raise(score_ids_problem(info, teacher))
    if wire.dtype != scoring_pb2.INT32:
        name = scoring_pb2.DType.Name(wire.dtype) if wire.dtype in scoring_pb2.DType.values() else str(wire.dtype)
        raise invalid("score_ids", f"must be an INT32 tensor, got {name}")
    rows = count - first_row
    shape = list(wire.shape)
    if len(shape) != 2:
        raise invalid("score_ids", f"must be 2-D [rows, K], got shape {shape}")
    if shape[0] != rows:
        raise invalid("score_ids", f"has {shape[0]} rows, but {rows} are scored (rows {first_row}..{count - 1}: one a "
                      "token, from first_row to the last): send one row of ids per scored token")
    k = shape[1]
    if not 1 <= k <= info.max_topk:
        raise invalid("score_ids", f"has K = {k} ids per row; teacher {teacher!r} scores 1 to {info.max_topk}")
    if wire.first_row not in (0, first_row):
        raise invalid("score_ids", f"says first_row {wire.first_row}, but the response starts at row {first_row}")
    if len(wire.data) != rows * k * 4:
        raise invalid("score_ids", f"has {len(wire.data)} bytes of data for shape {shape} (int32: {rows * k * 4})")
    ids = np.frombuffer(wire.data, dtype="<i4").reshape(rows, k)
    low, high = int(ids.min()), int(ids.max())
    if low < -1 or high >= info.vocab_size:
        bad = low if low < -1 else high
        row, col = (int(x) for x in np.argwhere(ids == bad)[0])
        raise invalid("score_ids", f"id {bad} at row {first_row + row}, column {col} is outside "
                      f"[0, {info.vocab_size}) (-1 pads a row)")
    return ids


def _replica(request: scoring_pb2.ScoreRequest, teacher_set: ReplicaSet) -> str | None:
    """The replica a request is pinned to (None: routed as usual); one the teacher lacks is refused."""
    if not request.replica:
        return None
    ids = [r.replica_id for r in teacher_set.replicas]
    if request.replica not in ids:
        raise invalid("replica", f"teacher {teacher_set.name!r} has no replica {request.replica!r} "
                      f"(its replicas: {', '.join(ids)})")
    return request.replica


def _temperature(request: scoring_pb2.ScoreRequest, info: EngineInfo, teacher: str) -> float:
    """The request's temperature (1 when unset). T != 1 is refused by an engine that cannot divide
    the logits before the log-softmax: a silently unscaled answer would look right and train wrong."""
    if not request.HasField("temperature"):
        return 1.0
    value = request.temperature
    if not math.isfinite(value) or value <= 0:
        raise invalid("temperature", f"is {value}; it must be a finite number > 0")
    if not SCORES_FINFO.tiny <= value <= SCORES_FINFO.max:  # float32(T) inf or subnormal: 1/T overflows
        raise invalid("temperature", f"is {value}; the logits are divided by it in {SCORES_FINFO.dtype}, where it must "
                      f"be in [{SCORES_FINFO.tiny:.3g}, {SCORES_FINFO.max:.3g}]")
    if value != 1.0 and not info.temperature:
        raise invalid("temperature", f"is {value}; teacher {teacher!r} ({info.engine} engine) scores at "
                      "temperature 1 only (its log-probs come from the raw logits)")
    return float(value)


def check_finite(request: EngineRequest, result: EngineResult | EncodedResult) -> None:
    """An answer with NaN (or a log-prob of +inf) is never sent (JSON has no NaN): at a
    temperature other than 1 it is the request's own input that overflowed float32 (logits / T),
    so the caller's INVALID_ARGUMENT; at T = 1 the engine's fault (INTERNAL)."""
    bad = nonfinite_outputs(result)  # read where the engine ran: the front reads no row (`worker.wire`)
    if not bad:
        return
    if request.temperature != 1.0:
        raise invalid("temperature", f"is {request.temperature}; the logits divided by it are not finite in "
                      f"{SCORES_FINFO.dtype} ({', '.join(bad)} would hold NaN); use a larger temperature")
    raise ScoringError(Code.INTERNAL, f"the engine's answer holds NaN in {', '.join(bad)}")


def _media_inputs(request: scoring_pb2.ScoreRequest, info: EngineInfo, teacher: str) -> MultiModalInputs | None:
    if not (request.images or request.videos or request.audios or request.mm_processor_kwargs):
        return None  # a text request (most of them) builds nothing
    media = MultiModalInputs(
        images=_items(request.images, "images"),
        videos=_items(request.videos, "videos"),
        audios=_items(request.audios, "audios"),
        processor_kwargs=processor_kwargs(request.mm_processor_kwargs),
    )
    _raise(media_problem(info, teacher, media.kinds()))
    return media


def _items(items, field: str) -> tuple[MediaItem, ...]:
    return tuple(media_item(field, index, item.data, item.media_type) for index, item in enumerate(items))
