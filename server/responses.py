"""Every answer to a scored request is built here, and its bytes counted here.

Both transports (and the protobuf and JSON flavours of HTTP) ask `Responses` for a unary
message, its serialised bytes, stream chunks or a JSON body, so the row convention and dtypes
are decided in one place, and `proctor:response_bytes` counts exactly what is sent.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import torch

from proctor.proto import dtype_name, encode_tensor, iter_row_chunks, scoring_pb2
from proctor.server.metrics import MetricsSink
from proctor.server.service import ScoredRequest


def _header(scored: ScoredRequest) -> dict:
    return {
        "request_id": scored.request_id,
        "teacher": scored.teacher,
        "model": scored.model,
        "num_tokens": scored.num_tokens,
        "first_row": scored.result.first_row,
    }


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast only when needed (engines already return wire dtypes; a cast is a torch dispatch)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _small_outputs(scored: ScoredRequest) -> dict:
    result, first = scored.result, scored.result.first_row
    out = {}
    if result.logprobs is not None:
        out["logprobs"] = encode_tensor(_as(result.logprobs, torch.float32), first_row=first)
    if result.topk_ids is not None:
        out["topk_ids"] = encode_tensor(_as(result.topk_ids, torch.int32), first_row=first)
        out["topk_logprobs"] = encode_tensor(_as(result.topk_logprobs, torch.float32), first_row=first)
    if result.score_logprobs is not None:
        out["score_logprobs"] = encode_tensor(_as(result.score_logprobs, torch.float32), first_row=first)
    return out


def _response(scored: ScoredRequest) -> scoring_pb2.ScoreResponse:
    response = scoring_pb2.ScoreResponse(**_header(scored), **_small_outputs(scored))
    if scored.result.hidden_states is not None:
        response.hidden_states.CopyFrom(encode_tensor(scored.result.hidden_states, first_row=scored.result.first_row))
    return response


def _chunks(scored: ScoredRequest, *, chunk_bytes: int) -> Iterator[scoring_pb2.ScoreChunk]:
    """Header and small outputs first, then hidden states in chunks of whole rows."""
    header = _header(scored)
    hidden = scored.result.hidden_states
    pieces = list(iter_row_chunks(hidden, first_row=scored.result.first_row, target_bytes=chunk_bytes)) if hidden is not None else []
    first = scoring_pb2.ScoreResponse(**header, **_small_outputs(scored))
    yield scoring_pb2.ScoreChunk(response=first, last=not pieces)
    for index, piece in enumerate(pieces):
        rows = scoring_pb2.ScoreResponse(request_id=scored.request_id, hidden_states=piece)
        yield scoring_pb2.ScoreChunk(response=rows, last=index == len(pieces) - 1)


def _rows_with_nulls(values: torch.Tensor, first_row: int, num_tokens: int) -> list:
    """All T rows for JSON: null where a row has no value (row 0, prompt rows)."""
    return [None] * first_row + values.tolist() + [None] * (num_tokens - first_row - values.shape[0])


def _finite_or_null(values: torch.Tensor) -> list:
    """[R, K] rows as lists with null for -inf (padded score_ids): JSON has no infinity."""
    rows = values.float().tolist()
    return [[v if v != float("-inf") else None for v in row] for row in rows]


def _json(scored: ScoredRequest) -> dict:
    result, first, total = scored.result, scored.result.first_row, scored.num_tokens
    body: dict = {**_header(scored)}
    if result.logprobs is not None:
        body["logprobs"] = _rows_with_nulls(result.logprobs.float(), first, total)
    if result.topk_ids is not None:
        body["topk_ids"] = _rows_with_nulls(result.topk_ids, first, total)
        body["topk_logprobs"] = _rows_with_nulls(result.topk_logprobs.float(), first, total)
    if result.score_logprobs is not None:
        rows = _finite_or_null(result.score_logprobs)
        body["score_logprobs"] = [None] * first + rows + [None] * (total - first - len(rows))
    if result.hidden_states is not None:
        wire = encode_tensor(result.hidden_states, first_row=first)
        body["hidden_states"] = {
            "dtype": dtype_name(wire.dtype),
            "shape": list(wire.shape),
            "first_row": first,
            "data": base64.b64encode(wire.data).decode("ascii"),
        }
    return body


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

    def message(self, scored: ScoredRequest) -> scoring_pb2.ScoreResponse:
        """The unary ScoreResponse (gRPC serialises it)."""
        response = _response(scored)
        self.metrics.response_sent(scored.teacher, scored.mode, response.ByteSize())
        return response

    def protobuf(self, scored: ScoredRequest) -> bytes:
        """The unary ScoreResponse, serialised (HTTP's protobuf answer)."""
        payload = _response(scored).SerializeToString()
        self.metrics.response_sent(scored.teacher, scored.mode, len(payload))
        return payload

    def json(self, scored: ScoredRequest) -> bytes:
        """The JSON answer: all T rows, null where a row has no value."""
        payload = json.dumps(_json(scored), separators=(",", ":")).encode()
        self.metrics.response_sent(scored.teacher, scored.mode, len(payload))
        return payload

    def chunks(self, scored: ScoredRequest) -> Iterator[scoring_pb2.ScoreChunk]:
        """The streamed answer: header and small outputs, then hidden states in whole rows."""
        for chunk in _chunks(scored, chunk_bytes=self.chunk_bytes):
            self.metrics.response_sent(scored.teacher, scored.mode, chunk.ByteSize())
            yield chunk

    def unembedding(self, weight: torch.Tensor, fingerprint: str) -> Iterator[scoring_pb2.TensorChunk]:
        """A teacher's [V, H] lm_head in whole rows, each chunk with the full shape and fingerprint."""
        return _unembedding_chunks(weight, fingerprint, chunk_bytes=self.chunk_bytes)
