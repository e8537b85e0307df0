"""An engine's result as the wire's bytes, made where the engine runs (the replica worker).

Why: the front process serves every replica of a node, so what it does per scored token sets
how many replicas one server can feed. A replica worker therefore turns each `EngineResult`
into `EncodedResult` before it crosses to the front: the small outputs (log-probs, top-k,
score_ids log-probs) as the serialised `ScoreResponse` fields that carry them, the hidden
states as their raw little-endian rows. The front then only splices bytes (`responses`):
no tensor is rebuilt or re-encoded there, and a result pickles as a few `bytes` objects
(a torch tensor pickles through `torch.save`, tens of µs each).

Readers that want tensors (the JSON answer, vLLM's `/v1/completions`, tests) get them from the
same attribute names as `EngineResult`'s, decoded lazily and without a copy.

Whether a score output holds NaN or +inf (an answer the front must never send) is read here too,
while the tensors are at hand (`nonfinite_outputs`), and travels as a few names: the front's check
(`validation.check_finite`) then reads no row of a gRPC answer.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Any

import numpy as np
import torch

from proctor.proto import WIRE_DTYPES, encode_tensor, scoring_pb2
from proctor.server.engines.base import EngineResult, Outcome
from proctor.server.worker.protocol import out_of_band

# EngineResult fields that travel inside the ScoreResponse bytes, and their wire dtype.
SMALL_OUTPUTS = {
    "logprobs": torch.float32,
    "topk_ids": torch.int32,
    "topk_logprobs": torch.float32,
    "score_logprobs": torch.float32,
}
_TENSOR_FIELDS = (*SMALL_OUTPUTS, "hidden_states", "ranks")
# The outputs that hold log-probs: never NaN, never +inf (`nonfinite_outputs`).
SCORE_OUTPUTS = ("logprobs", "topk_logprobs", "score_logprobs")


@dataclasses.dataclass(frozen=True)
class RawRows:
    """A [rows, ...] tensor as wire dtype, shape and raw little-endian bytes (row-major)."""

    dtype: int  # scoring_pb2.DType
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> RawRows:
        wire = encode_tensor(tensor)
        return cls(wire.dtype, tuple(wire.shape), wire.data)

    def __reduce_ex__(self, protocol: int):  # the rows' bytes beside the pickle, not in it
        return RawRows, (self.dtype, self.shape, out_of_band(self.data, protocol))

    @property
    def row_bytes(self) -> int:
        return len(self.data) // self.shape[0] if self.shape and self.shape[0] else 0

    def tensor(self) -> torch.Tensor:
        """A tensor over these bytes (no copy; read-only in spirit, as decoded wire tensors are)."""
        np_dtype, torch_dtype = WIRE_DTYPES[self.dtype]
        if not self.data:
            return torch.empty(self.shape, dtype=torch_dtype)
        array = np.frombuffer(self.data, dtype=np_dtype)
        import warnings

        with warnings.catch_warnings():  # torch warns that the buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        if torch_dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        return tensor.reshape(self.shape)


class _SmallOutput:
    """An `EncodedResult` attribute named as `EngineResult`'s: the tensor its output field holds."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, result: EncodedResult | None, owner: type | None = None) -> Any:
        return self if result is None else result._small(self.name)


class EncodedResult:
    """An `EngineResult` in wire form: `outputs` (serialised ScoreResponse fields of the small
    outputs), `hidden` (raw rows), `raw_ranks`, and the result's other fields as they were."""

    def __init__(self, outputs: bytes, hidden: RawRows | None, raw_ranks: RawRows | None, **scalars: Any) -> None:
        self.outputs = outputs
        self.hidden = hidden
        self.raw_ranks = raw_ranks
        self.first_row: int = scalars.pop("first_row")
        self.queue_seconds: float = scalars.pop("queue_seconds", 0.0)
        self.engine_seconds: float = scalars.pop("engine_seconds", 0.0)
        self.nonfinite: tuple[str, ...] = tuple(scalars.pop("nonfinite", ()))  # `nonfinite_outputs`, read at encoding
        self.__dict__.update(scalars)  # what else the engine reported (e.g. prompt_reused_tokens)

    def __reduce_ex__(self, protocol: int):  # the outputs' bytes beside the pickle, not in it
        scalars = {k: v for k, v in self.__dict__.items() if k not in ("outputs", "hidden", "raw_ranks", "_message")}
        return _rebuild, (out_of_band(self.outputs, protocol), self.hidden, self.raw_ranks, scalars)

    @cached_property
    def _message(self) -> scoring_pb2.ScoreResponse:
        return scoring_pb2.ScoreResponse.FromString(bytes(self.outputs))

    def _small(self, name: str) -> torch.Tensor | None:
        if not self._message.HasField(name):
            return None
        wire = getattr(self._message, name)
        return RawRows(wire.dtype, tuple(wire.shape), wire.data).tensor()

    logprobs = _SmallOutput()
    topk_ids = _SmallOutput()
    topk_logprobs = _SmallOutput()
    score_logprobs = _SmallOutput()

    @property
    def hidden_states(self) -> torch.Tensor | None:
        return self.hidden.tensor() if self.hidden is not None else None

    @property
    def ranks(self) -> torch.Tensor | None:
        return self.raw_ranks.tensor() if self.raw_ranks is not None else None


def _rebuild(outputs: bytes, hidden: RawRows | None, raw_ranks: RawRows | None, scalars: dict) -> EncodedResult:
    return EncodedResult(outputs, hidden, raw_ranks, **scalars)


def encode_result(result: EngineResult | EncodedResult) -> EncodedResult:
    """The wire form of one result (an already encoded one is returned as it is)."""
    if isinstance(result, EncodedResult):
        return result
    first = result.first_row
    small = {}
    for name, dtype in SMALL_OUTPUTS.items():
        value = getattr(result, name)
        if value is not None:
            small[name] = encode_tensor(value if value.dtype == dtype else value.to(dtype), first_row=first)
    outputs = scoring_pb2.ScoreResponse(**small).SerializeToString() if small else b""
    hidden = RawRows.of(result.hidden_states) if result.hidden_states is not None else None
    ranks = RawRows.of(result.ranks) if result.ranks is not None else None
    scalars = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name not in _TENSOR_FIELDS}
    return EncodedResult(outputs, hidden, ranks, nonfinite=nonfinite_outputs(result), **scalars)


def nonfinite_outputs(result: EngineResult | EncodedResult) -> tuple[str, ...]:
    """The score outputs of `result` that hold NaN or +inf (-inf is a log-prob: padding, or a
    token of probability 0). An encoded result says what was read when it was encoded, where
    the engine ran; otherwise one max a tensor (NaN propagates through it), no temporaries."""
    if isinstance(result, EncodedResult):
        return result.nonfinite
    bad = []
    for name in SCORE_OUTPUTS:
        values = getattr(result, name)
        if values is not None and values.numel():
            top = float(values.max())
            if top != top or top == float("inf"):
                bad.append(name)
    return tuple(bad)


def encode_outcomes(outcomes: list[Outcome]) -> list[Outcome | EncodedResult]:
    """A batch's outcomes with every result in wire form (errors pass as they are)."""
    return [encode_result(o) if isinstance(o, EngineResult) else o for o in outcomes]
