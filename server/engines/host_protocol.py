"""The messages between the server and an engine host process, and their framing.

A frame is an 8-byte little-endian length and a pickle. Pickle, because what travels is the
engine protocol's own dataclasses (requests, results with their tensors, outcomes) between two
processes of one installation that trust each other (the host is our own child, on a socket
pair nobody else holds). Messages are tuples whose first item names them:

server → host: ("start", spec) · ("score", call, batch) · ("abort", keys) · ("health", call) ·
               ("close",)
host → server: ("ready", info, token_budget) · ("start_failed", message) ·
               ("reply", call, value) · ("failed", call, message)
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

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


def write_message(writer: asyncio.StreamWriter, message: tuple[Any, ...]) -> None:
    """Queue one whole frame (one write call, so frames from concurrent tasks never interleave)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_HEADER.pack(len(payload)) + payload)
