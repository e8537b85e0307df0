"""Length-delimited protobuf messages on one byte stream (HTTP's answer to a gRPC stream).

Each message travels as a 4-byte little-endian length, then its bytes. The server frames
`ScoreChunk`s and `TensorChunk`s; the client splits the body back into the same messages it
would have read from gRPC, so both transports share one decoding path.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator

from google.protobuf.message import Message

STREAM_MEDIA_TYPE = "application/x-protobuf-stream"
_HEADER = struct.Struct("<I")


def frame(message: Message | bytes) -> bytes:
    payload = message if isinstance(message, bytes) else message.SerializeToString()
    return _HEADER.pack(len(payload)) + payload


async def read_frames(chunks: AsyncIterator[bytes], message_type: type[Message], *, max_frame: int = 256 << 20):
    """Yield messages of message_type from a byte stream of frames; a truncated stream raises."""
    buffer = bytearray()
    async for data in chunks:
        buffer.extend(data)
        while len(buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer)
            if size > max_frame:
                raise ValueError(f"frame of {size} bytes exceeds the limit of {max_frame}")
            if len(buffer) < _HEADER.size + size:
                break
            message = message_type()
            message.ParseFromString(bytes(buffer[_HEADER.size : _HEADER.size + size]))
            del buffer[: _HEADER.size + size]
            yield message
    if buffer:
        raise ValueError(f"stream ended inside a frame ({len(buffer)} bytes left over)")
