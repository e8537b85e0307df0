"""The framing of the front ↔ replica worker socket: one message a frame, its large buffers out of band.

A frame is an 8-byte little-endian length, then a count of out-of-band buffers, the pickle's
length, each buffer's length and place, the pickle, and the buffers that travel in the frame: a
buffer's place is 0 in the frame, or 1 + its offset in the worker's shared arena
(`worker.arena`: where the worker puts the large buffers of its replies, so the front reads them
without a socket copy). Pickle, because what travels is the engine protocol's
own dataclasses (requests, outcomes) between two processes of one installation that trust each
other (the worker is the front's own child, on a socket pair nobody else holds). Results travel
in wire form (`wire.EncodedResult`, a few `bytes`); the large ones (a top-64 answer, hidden
states) go out of band (pickle protocol 5), so the reader gets them as views of the one buffer
the socket was read into (`Channel`, an asyncio buffered protocol): one copy from the kernel
and none in Python. A request's ids are numpy int32 arrays (`engines.base`), which protocol 5
carries out of band as they are (no copy to send; the worker's array is a view of its frame). A
CPU torch tensor (an unembedding) pickles as its raw bytes, dtype and shape: torch's own pickling
goes through `torch.save` and costs tens of µs a tensor, on the event loop. What the frames carry is `messages`' codec: typed messages as tuples.
"""

from __future__ import annotations

import asyncio
import io
import logging
import pickle
import socket
import struct
from typing import Any

import numpy as np
import torch

from proctor.proto import DTYPES
from proctor.server.worker.arena import ArenaReader, ArenaWriter
from proctor.server.worker.messages import Free, Message, decode, encode

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")
_PLACE = struct.Struct("<QQ")  # (count, pickle length), then per buffer (length, place)
# A frame larger than this is a broken stream, not a message (hidden states are ~MiBs).
MAX_FRAME_BYTES = 16 << 30
# Bytes at least this large travel out of band (see `out_of_band`).
OUT_OF_BAND_BYTES = 64 << 10
# Out-of-band bytes at least this large go through the shared arena, where the channel has one.
ARENA_MIN_BYTES = OUT_OF_BAND_BYTES


def out_of_band(data: bytes, protocol: int) -> bytes | pickle.PickleBuffer:
    """What a reducer pickles in place of a large `bytes`: a PickleBuffer, which protocol 5
    carries beside the pickle and the reader gets back as a view of its frame (no copies)."""
    if protocol >= 5 and len(data) >= OUT_OF_BAND_BYTES:
        return pickle.PickleBuffer(data)
    return data


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


def frame(message: Any, arena: ArenaWriter | None = None) -> list[bytes | memoryview]:
    """`message` as one frame's parts (tensors as raw bytes, large bytes out of band: in `arena`
    where one is given and has room, else in the frame)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(message)
    pickled = stream.getbuffer()
    inline: list[memoryview] = [pickled]
    places = [_PLACE.pack(len(buffers), pickled.nbytes)]
    for buffer in buffers:
        raw = buffer.raw()
        offset = arena.place(raw) if arena is not None and raw.nbytes >= ARENA_MIN_BYTES else None
        if offset is None:
            inline.append(raw)
        places.append(_PLACE.pack(raw.nbytes, 0 if offset is None else offset + 1))
    head = b"".join(places)
    size = len(head) + sum(v.nbytes for v in inline)
    return [_HEADER.pack(size), head, *inline]


def dumps(message: Any) -> bytes:
    """`message` as the bytes of one frame."""
    return b"".join(frame(message))


def parse(body: memoryview, arena: ArenaReader | None = None) -> Any:
    """The message of a frame's body (after its length); out-of-band buffers are views of it or,
    those placed in the shared arena, of `arena`."""
    count, pickled = _PLACE.unpack_from(body)
    places = [_PLACE.unpack_from(body, _PLACE.size * (1 + i)) for i in range(count)]
    offset = _PLACE.size * (1 + count)
    views = [body[offset : offset + pickled]]
    offset += pickled
    for length, place in places:
        if place:
            if arena is None:
                raise ConnectionError("replica worker frame names a shared arena this end does not have")
            views.append(arena.view(place - 1, length))
        else:
            views.append(body[offset : offset + length])
            offset += length
    if offset != len(body):
        raise ConnectionError(f"replica worker frame of {len(body)} bytes holds {offset}: the stream is corrupt")
    return pickle.loads(views[0], buffers=views[1:])


def loads(data: bytes) -> Any:
    """The message of one frame given as bytes (`dumps`'s inverse)."""
    return parse(memoryview(data)[_HEADER.size :])


class _FrameProtocol(asyncio.BufferedProtocol):
    """Reads frames straight into a buffer of the frame's size; queues their messages."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue = asyncio.Queue()
        self._header = bytearray(_HEADER.size)
        self._body: np.ndarray | None = None
        self._filled = 0
        self._writable = asyncio.Event()
        self._writable.set()
        self.transport: asyncio.Transport | None = None
        self.arena: ArenaReader | None = None  # where this end reads the arena's buffers

    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        target = memoryview(self._header) if self._body is None else memoryview(self._body)
        return target[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._body is None:
            if self._filled < _HEADER.size:
                return
            (size,) = _HEADER.unpack(self._header)
            if size > MAX_FRAME_BYTES:
                log.error("replica worker frame of %d bytes: the stream is corrupt", size)
                self.transport.close()
                return
            self._body, self._filled = np.empty(size, np.uint8), 0  # not zero-filled: recv_into fills it
            if size:
                return
        if self._filled < len(self._body):
            return
        body, self._body, self._filled = self._body, None, 0
        try:
            self.messages.put_nowait(parse(memoryview(body), self.arena))
        except Exception:
            log.exception("unreadable frame from the other end of a replica worker's socket")
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.messages.put_nowait(None)
        self._writable.set()

    async def writable(self) -> None:
        """Return once the socket's write buffer is under its high-water mark."""
        await self._writable.wait()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()


class Channel:
    """One end of the front ↔ worker socket: `send` frames, `receive` messages (None at the end).

    A worker's channel may write the large buffers of its frames into a shared arena
    (`use_arena_for_sending`); the front's reads them there (`read_arena`) and reports the blocks
    it is done with as `Free` messages."""

    def __init__(self, transport: asyncio.Transport, protocol: _FrameProtocol) -> None:
        self.transport = transport
        self.protocol = protocol
        self.arena_out: ArenaWriter | None = None

    @classmethod
    async def open(cls, sock: socket.socket) -> Channel:
        transport, protocol = await asyncio.get_running_loop().create_unix_connection(_FrameProtocol, sock=sock)
        return cls(transport, protocol)

    def use_arena_for_sending(self, fd: int) -> None:
        self.arena_out = ArenaWriter(fd)

    def read_arena(self, fd: int) -> None:
        def report(offsets: list[int]) -> None:
            if not self.transport.is_closing():
                self.send(Free(offsets))

        self.protocol.arena = ArenaReader(fd, report)

    def send(self, message: Message) -> None:
        """Queue one whole frame (one call, no await: frames from concurrent tasks never interleave)."""
        self.transport.writelines(frame(encode(message), self.arena_out))

    async def drain(self) -> None:
        """Wait while the socket's write buffer is over its high-water mark."""
        await self.protocol.writable()

    async def receive(self) -> Message | None:
        """The next message; None once the other end has gone."""
        raw = await self.protocol.messages.get()
        return None if raw is None else decode(raw)

    def close(self) -> None:
        self.transport.close()
