"""The messages between the server and an engine host process, and their framing.

A frame is an 8-byte little-endian length and a pickle. Pickle, because what travels is the
engine protocol's own dataclasses (requests, outcomes) between two processes of one
installation that trust each other (the host is our own child, on a socket pair nobody else
holds). Results travel in wire form (`wire_result.EncodedResult`, a few `bytes`), and a CPU
torch tensor (a request's token ids) pickles as its raw bytes, dtype and shape: torch's own
pickling goes through `torch.save` and costs tens of µs a tensor, on the front's event loop.
Messages are tuples whose first item names them:

server → host: ("start", spec, build) · ("score", call, batch) · ("abort", keys) · ("health", call) ·
               ("close",)   (build: the engine factory, None for `create_engine`)
host → server: ("ready", info, token_budget) · ("start_failed", message) ·
               ("reply", call, value) · ("failed", call, message)
"""

from __future__ import annotations

import asyncio
import io
import pickle
import struct
from typing import Any

import numpy as np
import torch

from proctor.proto import DTYPES

_HEADER = struct.Struct("<Q")
# A frame larger than this is a broken stream, not a message (hidden states are ~MiBs).
MAX_FRAME_BYTES = 16 << 30


async def read_message(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
    """The next message, or None at the end of the stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"engine host frame of {size} bytes: the stream is corrupt")
    try:
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
    return pickle.loads(payload)


_BY_TORCH = {torch_dtype: name for name, (_, _, torch_dtype) in DTYPES.items()}


def _rebuild_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    _, np_dtype, torch_dtype = DTYPES[dtype]
    tensor = torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy())  # writable, as sent
    return (tensor.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else tensor).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickle with CPU tensors as (raw bytes, dtype, shape); anything else as pickle does it."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.dtype in _BY_TORCH and not obj.requires_grad:
            storage = obj.contiguous()
            if storage.dtype == torch.bfloat16:
                storage = storage.view(torch.int16)
            return _rebuild_tensor, (storage.numpy().tobytes(), _BY_TORCH[obj.dtype], tuple(obj.shape))
        return NotImplemented


def dumps(message: Any) -> bytes:
    """`message` pickled, tensors as raw bytes (see the module's docstring)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def write_message(writer: asyncio.StreamWriter, message: tuple[Any, ...]) -> None:
    """Queue one whole frame (one write call, so frames from concurrent tasks never interleave)."""
    payload = dumps(message)
    writer.writelines((_HEADER.pack(len(payload)), payload))  # no await between: never interleaved
