"""Tensor codec: torch / numpy arrays to and from the wire `Tensor{dtype, shape, data}`.

Data travel as raw little-endian row-major bytes, so decoding is a zero-copy view over the
message's bytes (read-only; copy before writing). bfloat16 has no numpy dtype, so it travels
as its raw 16-bit pattern and decodes straight into a torch tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import torch

from proctor.proto import scoring_pb2

# The one dtype table: name -> (wire enum, numpy storage dtype, torch dtype). Names are the
# enum's lower-cased (what configs, JSON and logs say: "bfloat16").
DTYPES: dict[str, tuple[int, np.dtype, torch.dtype]] = {
    "float32": (scoring_pb2.FLOAT32, np.dtype("<f4"), torch.float32),
    "float16": (scoring_pb2.FLOAT16, np.dtype("<f2"), torch.float16),
    "bfloat16": (scoring_pb2.BFLOAT16, np.dtype("<u2"), torch.bfloat16),
    "float64": (scoring_pb2.FLOAT64, np.dtype("<f8"), torch.float64),
    "int32": (scoring_pb2.INT32, np.dtype("<i4"), torch.int32),
    "int64": (scoring_pb2.INT64, np.dtype("<i8"), torch.int64),
    # Packed fp8 rows (`hidden_forms`): uint8 [R, D + 4], each row D e4m3 bytes and its float32 scale.
    "float8_e4m3_rows": (scoring_pb2.FLOAT8_E4M3_ROWS, np.dtype("u1"), torch.uint8),
}
WIRE_DTYPES: dict[int, tuple[np.dtype, torch.dtype]] = {wire: (np_dt, t) for wire, np_dt, t in DTYPES.values()}
_TORCH_TO_WIRE = {torch_dtype: wire for wire, _, torch_dtype in DTYPES.values()}
_NUMPY_TO_WIRE = {np.dtype(np_dtype).newbyteorder("="): wire for name, (wire, np_dtype, _) in DTYPES.items()
                  if name != "bfloat16"}


def dtype_name(wire: int) -> str:
    """"bfloat16" for scoring_pb2.BFLOAT16 (the names configs and JSON use)."""
    return scoring_pb2.DType.Name(wire).lower()


def wire_dtype(name: str) -> int:
    """The wire enum of a dtype name ("float32", "torch.bfloat16"); ValueError if unknown."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DTYPES)})")
    return DTYPES[key][0]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name ("float32", "torch.bfloat16"); ValueError if unknown."""
    return WIRE_DTYPES[wire_dtype(name)][1]


if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("proctor's tensor codec assumes a little-endian host")


def encode_tensor(value: torch.Tensor | np.ndarray, *, first_row: int = 0) -> scoring_pb2.Tensor:
    """Pack a tensor as raw bytes; bf16 keeps its 16-bit pattern (half the bytes of float32)."""
    if isinstance(value, torch.Tensor):
        # Each torch call below is skipped when it would be a no-op: on a server's event loop
        # every dispatch into torch can wait on the engine thread, so the fast path matters.
        tensor = value.detach() if value.requires_grad else value
        if tensor.dtype not in _TORCH_TO_WIRE:
            raise ValueError(f"tensor dtype {tensor.dtype} has no wire encoding")
        wire = _TORCH_TO_WIRE[tensor.dtype]
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        storage = tensor.view(torch.int16) if wire == scoring_pb2.BFLOAT16 else tensor
        data = storage.numpy().tobytes()
        shape = list(tensor.shape)
    else:
        array = np.ascontiguousarray(value)
        key = array.dtype.newbyteorder("=")
        if key not in _NUMPY_TO_WIRE:
            raise ValueError(f"array dtype {array.dtype} has no wire encoding")
        wire = _NUMPY_TO_WIRE[key]
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        shape = list(array.shape)
    return scoring_pb2.Tensor(dtype=wire, shape=shape, data=data, first_row=first_row)


def _check(message: scoring_pb2.Tensor) -> tuple[np.dtype, torch.dtype, tuple[int, ...]]:
    if message.dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown tensor dtype {message.dtype}")
    np_dtype, torch_dtype = WIRE_DTYPES[message.dtype]
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in tensor shape {shape}")
    expected = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    if len(message.data) != expected:
        raise ValueError(
            f"tensor data has {len(message.data)} bytes, shape {shape} of {dtype_name(message.dtype)} needs {expected}"
        )
    return np_dtype, torch_dtype, shape


def decode_numpy(message: scoring_pb2.Tensor) -> np.ndarray:
    """A read-only numpy view over the message bytes (bf16 is refused: numpy has no bf16)."""
    np_dtype, _, shape = _check(message)
    if message.dtype == scoring_pb2.BFLOAT16:
        raise ValueError("bfloat16 cannot be decoded to numpy; use decode_tensor")
    return np.frombuffer(message.data, dtype=np_dtype).reshape(shape)


def decode_tensor(message: scoring_pb2.Tensor) -> torch.Tensor:
    """A torch tensor sharing the message's bytes (no copy); it is read-only in spirit."""
    np_dtype, torch_dtype, shape = _check(message)
    if not message.data:
        return torch.empty(shape, dtype=torch_dtype)
    raw = np.frombuffer(message.data, dtype=np_dtype)
    import warnings

    with warnings.catch_warnings():
        # torch warns that the buffer is not writable; callers treat decoded tensors as read-only.
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(raw)
    if torch_dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor.reshape(shape)


def rows_per_chunk(row_bytes: int, target_bytes: int = 2 << 20) -> int:
    """Whole rows per chunk so that a chunk stays near target_bytes (at least one row)."""
    return max(1, target_bytes // max(1, row_bytes))


def iter_row_chunks(
    value: torch.Tensor, *, first_row: int = 0, target_bytes: int = 2 << 20
) -> Iterator[scoring_pb2.Tensor]:
    """Split a [rows, ...] tensor into wire tensors of whole rows, each saying its first row."""
    if value.dim() == 0:
        raise ValueError("cannot chunk a scalar tensor")
    row_bytes = value[0:1].numel() * value.element_size() if value.shape[0] else 1
    step = rows_per_chunk(row_bytes, target_bytes)
    if value.shape[0] == 0:
        yield encode_tensor(value, first_row=first_row)
        return
    for start in range(0, value.shape[0], step):
        yield encode_tensor(value[start : start + step], first_row=first_row + start)
