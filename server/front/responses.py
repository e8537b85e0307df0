"""Every answer to a scored request is built here, and its bytes counted here.

Both transports (and the protobuf and JSON flavours of HTTP, vLLM's `/v1/completions` and its
`/inference/v1/generate`) ask
`Responses` for a unary answer's bytes, stream chunks' bytes or a JSON body, so the row
convention and dtypes are decided in one place, and `proctor:response_bytes` counts exactly what
is sent. A completions answer's JSON is written by `completion_json`, SGLang's `/generate` answer by
`generate_json`; only this class calls them.

The protobuf answers are spliced, not built: a result arrives from its replica worker already
in wire form (`EncodedResult`: the serialised fields of the small outputs, the raw rows of the
hidden states), and an answer is the small header message's bytes followed by those fields
(protobuf allows a message's fields in any order, and a message field is a tag, a length and
the field's bytes). So the front process does no work per token: one join of a few byte
strings per answer (per chunk for streams), whatever the top-k or the hidden size.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from proctor.proto import dtype_name, iter_row_chunks, rows_per_chunk, scoring_pb2
from proctor.server.common.metrics import MetricsSink
from proctor.server.front.completion_json import CompletionForm, completion_answer
from proctor.server.front.float_text import json_items
from proctor.server.front.generate_json import EntryText, Finish, Planned, generate_answer
from proctor.server.front.service import ScoredRequest
from proctor.server.front.tito_json import GeneratePlan, GenerateReply, tito_answer
from proctor.server.front.token_text import TokenText
from proctor.server.worker.wire import EncodedResult, RawRows, encode_result

_LEN = 2  # protobuf's wire type of length-delimited fields
_HIDDEN = scoring_pb2.ScoreResponse.DESCRIPTOR.fields_by_name["hidden_states"].number
_DATA = scoring_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number
_CHUNK_RESPONSE = scoring_pb2.ScoreChunk.DESCRIPTOR.fields_by_name["response"].number
_CHUNK_LAST = scoring_pb2.ScoreChunk(last=True).SerializeToString()
_ALIGNED = scoring_pb2.ScoreResponse.DESCRIPTOR.fields_by_name["aligned"].number
_ALIGNED_TEACHER = scoring_pb2.AlignedScores.DESCRIPTOR.fields_by_name["teacher"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(number: int) -> bytes:
    return _varint(number << 3 | _LEN)


def _header(scored: ScoredRequest) -> dict:
    return {
        "request_id": scored.request_id,
        "teacher": scored.teacher,
        "model": scored.model,
        "num_tokens": scored.num_tokens,
        "first_row": scored.first_row,
        "fingerprint": scored.result.fingerprint,
    }


def _teacher_part(scored: ScoredRequest) -> ScoredRequest:
    """An aligned request's teacher answer: its own rows over its own sequence."""
    return replace(scored, num_tokens=scored.aligned.teacher_num_tokens, aligned=None)


def _outputs(scored: ScoredRequest, wire: EncodedResult) -> list[bytes]:
    """ScoreResponse's output fields: the worker's, or for an aligned request its `aligned` field
    (the student-row outputs, then the teacher's own answer spliced from the worker's bytes)."""
    if scored.aligned is None:
        return [wire.outputs]
    teacher = scoring_pb2.ScoreResponse(**_header(_teacher_part(scored))).SerializeToString() + wire.outputs
    inner = scored.aligned.protobuf() + _tag(_ALIGNED_TEACHER) + _varint(len(teacher)) + teacher
    return [_tag(_ALIGNED), _varint(len(inner)), inner]


def _hidden_field(raw: RawRows, first_row: int, start: int, stop: int) -> list[bytes | memoryview]:
    """ScoreResponse's `hidden_states` field holding rows start..stop-1 of `raw`: parts to join."""
    row = raw.row_bytes
    data = memoryview(raw.data)[start * row : stop * row]
    head = scoring_pb2.Tensor(dtype=raw.dtype, shape=[stop - start, *raw.shape[1:]], first_row=first_row + start)
    tensor_head = head.SerializeToString() + _tag(_DATA) + _varint(len(data))
    return [_tag(_HIDDEN), _varint(len(tensor_head) + len(data)), tensor_head, data]


def _unary(scored: ScoredRequest) -> bytes:
    """The serialised ScoreResponse: header, the worker's output fields, the hidden states."""
    wire = encode_result(scored.result)
    parts: list[bytes | memoryview] = [scoring_pb2.ScoreResponse(**_header(scored)).SerializeToString(),
                                       *_outputs(scored, wire)]
    if wire.hidden is not None:
        parts += _hidden_field(wire.hidden, wire.first_row, 0, wire.hidden.shape[0])
    return b"".join(parts)


def _chunk(response_parts: list[bytes | memoryview], last: bool) -> bytes:
    """A serialised ScoreChunk around a ScoreResponse given as parts."""
    size = sum(len(p) for p in response_parts)
    return b"".join([_tag(_CHUNK_RESPONSE), _varint(size), *response_parts, _CHUNK_LAST if last else b""])


def _chunks(scored: ScoredRequest, *, chunk_bytes: int) -> Iterator[bytes]:
    """Header and small outputs first, then hidden states in chunks of whole rows."""
    wire = encode_result(scored.result)
    head = scoring_pb2.ScoreResponse(**_header(scored)).SerializeToString()
    hidden = wire.hidden
    if hidden is None:
        yield _chunk([head, *_outputs(scored, wire)], True)
        return
    yield _chunk([head, wire.outputs], False)
    rows = hidden.shape[0]
    step = rows_per_chunk(hidden.row_bytes or 1, chunk_bytes)
    starts = range(0, max(rows, 1), step)
    request_id = scoring_pb2.ScoreResponse(request_id=scored.request_id).SerializeToString()
    for index, start in enumerate(starts):
        stop = min(rows, start + step)
        yield _chunk([request_id, *_hidden_field(hidden, wire.first_row, start, stop)], index == len(starts) - 1)


# A JSON answer with more values than this is encoded in pieces on a worker thread (HTTP streams
# it), so that its encoding never holds the event loop (and gRPC with it) for long.
JSON_INLINE_VALUES = 1 << 16
# Rows encoded per piece: each piece's json.dumps holds the GIL briefly, then the loop runs.
JSON_PIECE_ROWS = 1024
# A completions answer with more (position, candidate) cells than this is built in a worker
# thread, as large bodies are decoded there: the event loop (gRPC too) keeps serving.
COMPLETION_INLINE_CELLS = 20_000


def _nulls(count: int) -> str:
    return ",".join(["null"] * count)


def _float_items(values: torch.Tensor) -> str:
    """[R] or [R, K] float rows as JSON items, null for -inf (padding) and NaN: JSON has neither
    (numpy-written text that reads back as the same float32: `float_text`)."""
    return json_items(values.float().numpy())


def _id_items(values: torch.Tensor) -> str:
    return json.dumps(values.tolist(), separators=(",", ":"))[1:-1]


def _json_items(values: torch.Tensor, first_row: int, num_tokens: int, rows_per_piece: int, convert) -> Iterator[str]:
    """The items of a T-row JSON list, in pieces: null where a row has no value (row 0, prompt rows)."""
    rows = values.shape[0]
    parts_before = bool(first_row)
    if first_row:
        yield _nulls(first_row)
    for start in range(0, rows, rows_per_piece):
        text = convert(values[start : start + rows_per_piece])
        yield ("," if parts_before else "") + text
        parts_before = True
    if num_tokens - first_row - rows:
        yield ("," if parts_before else "") + _nulls(num_tokens - first_row - rows)


def _json_list(name: str, values: torch.Tensor, scored: ScoredRequest, rows_per_piece: int, convert,
               *, lead: str = ",") -> Iterator[bytes]:
    """`"name":[...]` over all T rows of the answer, in pieces."""
    yield f'{lead}"{name}":['.encode()
    for piece in _json_items(values, scored.first_row, scored.num_tokens, rows_per_piece, convert):
        yield piece.encode()
    yield b"]"


def _aligned_json_pieces(scored: ScoredRequest, rows_per_piece: int) -> Iterator[bytes]:
    """An aligned answer's `"aligned":{...}` member: the student's T rows, the alignment, and the
    teacher's own JSON answer."""
    aligned = scored.aligned
    yield b',"aligned":{'
    for index, (name, values) in enumerate(aligned.rows()):
        convert = _id_items if "ids" in name else _float_items
        yield from _json_list(name, values, scored, rows_per_piece, convert, lead="," if index else "")
    yield (f',"chunks":{json.dumps(aligned.chunks.tolist(), separators=(",", ":"))}'
           f',"teacher_ids":{json.dumps(aligned.teacher_ids.tolist(), separators=(",", ":"))},"teacher":').encode()
    yield from _json_pieces(_teacher_part(scored), rows_per_piece)
    yield b"}"


def _json_pieces(scored: ScoredRequest, rows_per_piece: int) -> Iterator[bytes]:
    """The JSON answer (all T rows, null where a row has no value) as consecutive pieces."""
    result, first = scored.result, scored.first_row
    yield json.dumps(_header(scored), separators=(",", ":"))[:-1].encode()
    if scored.aligned is not None:
        yield from _aligned_json_pieces(scored, rows_per_piece)
        yield b"}"
        return
    lists = (
        ("logprobs", result.logprobs, _float_items),
        ("topk_ids", result.topk_ids, _id_items),
        ("topk_logprobs", result.topk_logprobs, _float_items),
        ("score_logprobs", result.score_logprobs, _float_items),
    )
    for name, values, convert in lists:
        if values is not None:
            yield from _json_list(name, values, scored, rows_per_piece, convert)
    hidden = result.hidden if isinstance(result, EncodedResult) else None
    if hidden is None and result.hidden_states is not None:
        hidden = RawRows.of(result.hidden_states)
    if hidden is not None:
        meta = {"dtype": dtype_name(hidden.dtype), "shape": list(hidden.shape), "first_row": first}
        yield f',"hidden_states":{json.dumps(meta, separators=(",", ":"))[:-1]},"data":"'.encode()
        yield base64.b64encode(hidden.data)
        yield b'"}'
    yield b"}"


def _json_values(scored: ScoredRequest) -> int:
    result = scored.result
    per_row = 1 + sum(v.shape[1] for v in (result.topk_ids, result.topk_logprobs, result.score_logprobs)
                      if v is not None)
    if scored.aligned is not None:  # the student's rows (about as wide), the teacher's inside
        return 2 * _json_values(_teacher_part(scored)) + scored.num_tokens * (per_row + 2)
    return scored.num_tokens * per_row


def _unembedding_chunks(weight: torch.Tensor, fingerprint: str, *, chunk_bytes: int) -> Iterator[scoring_pb2.TensorChunk]:
    """The [V, H] weight in whole rows, each chunk carrying the full shape and the fingerprint."""
    pieces = list(iter_row_chunks(weight, target_bytes=chunk_bytes))
    for index, piece in enumerate(pieces):
        yield scoring_pb2.TensorChunk(
            tensor=piece, full_shape=list(weight.shape), fingerprint=fingerprint, last=index == len(pieces) - 1
        )


class Responses:
    """Builds the answers of one server and reports each one's size to its metrics."""

    def __init__(self, metrics: MetricsSink, *, chunk_bytes: int = 2 << 20) -> None:
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes

    def protobuf(self, scored: ScoredRequest) -> bytes:
        """The unary ScoreResponse, serialised (gRPC's answer and HTTP's protobuf answer)."""
        payload = _unary(scored)
        self.metrics.response_sent(scored.teacher, scored.mode, len(payload))
        return payload

    def json(self, scored: ScoredRequest) -> bytes:
        """The JSON answer: all T rows, null where a row has no value."""
        payload = b"".join(_json_pieces(scored, JSON_PIECE_ROWS))
        self.metrics.response_sent(scored.teacher, scored.mode, len(payload))
        return payload

    def json_is_large(self, scored: ScoredRequest) -> bool:
        """Whether the JSON answer is too large to encode on the event loop (see `json_pieces`)."""
        return _json_values(scored) > JSON_INLINE_VALUES

    def json_pieces(self, scored: ScoredRequest, *, rows_per_piece: int = JSON_PIECE_ROWS) -> Iterator[bytes]:
        """The JSON answer in pieces, the same bytes as `json`: for a large answer, iterated on a
        worker thread (HTTP streams it), each piece a short hold of the GIL."""
        for piece in _json_pieces(scored, rows_per_piece):
            self.metrics.response_sent(scored.teacher, scored.mode, len(piece))
            yield piece

    def completion_is_large(self, prompts: Sequence[list[int]], topk: int) -> bool:
        """Whether a completions answer is too large to build on the event loop."""
        return sum(len(ids) * (topk + 1) for ids in prompts) > COMPLETION_INLINE_CELLS

    def completion(self, prompts: Sequence[list[int]], scored: Sequence[ScoredRequest], *, model: str,
                   form: CompletionForm, tokenizer: Any, text: TokenText) -> bytes:
        """vLLM's `/v1/completions` answer for prompts scored together (`completion_answer`) in the
        call's `form`; `tokenizer` decodes echoed prompts and generated tokens, `text` is the
        teacher's `decoded_token` table."""
        payload = completion_answer(prompts, scored, model=model, form=form, tokenizer=tokenizer, text=text)
        self.metrics.response_sent(scored[0].teacher, scored[0].mode, len(payload))
        return payload

    def generate(self, plans: Sequence[Planned], scored: Sequence[ScoredRequest], finishes: Sequence[Finish], *,
                 batch: bool, text: EntryText | None, latency: float) -> bytes:
        """SGLang's `/generate` answer for prompts scored together (`generate_answer`); `text` the
        teacher's entry text table when the call asked `return_text_in_logprobs`."""
        payload = generate_answer(plans, scored, finishes, batch=batch, text=text, latency=latency)
        self.metrics.response_sent(scored[0].teacher, scored[0].mode, len(payload))
        return payload

    def tito(self, plan: GeneratePlan, reply: GenerateReply, scored: ScoredRequest, *, text: TokenText) -> bytes:
        """vLLM's `/inference/v1/generate` answer for a call scored as `plan` (`tito_json`)."""
        payload = tito_answer(plan, reply, scored, text)
        self.metrics.response_sent(scored.teacher, scored.mode, len(payload))
        return payload

    def chunks(self, scored: ScoredRequest) -> Iterator[bytes]:
        """The streamed answer, serialised ScoreChunks: header and small outputs, then hidden
        states in whole rows."""
        for chunk in _chunks(scored, chunk_bytes=self.chunk_bytes):
            self.metrics.response_sent(scored.teacher, scored.mode, len(chunk))
            yield chunk

    def unembedding(self, weight: torch.Tensor, fingerprint: str) -> Iterator[scoring_pb2.TensorChunk]:
        """A teacher's [V, H] lm_head in whole rows, each chunk with the full shape and fingerprint."""
        return _unembedding_chunks(weight, fingerprint, chunk_bytes=self.chunk_bytes)
