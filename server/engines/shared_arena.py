"""Shared memory between the front and one replica worker, for the large buffers of replies.

Why: a top-64 answer or a request's hidden states is MiBs; through the socket it costs the
front a kernel copy into its frame buffer (and the reads), and the front then copies it once
more into the answer's bytes anyway (gRPC and HTTP take `bytes`). With the arena the worker
writes the buffer into memory both processes map and sends only where it lies; the front's one
copy reads it from there. The arena is a memfd (anonymous shared memory: not bounded by the
size of /dev/shm, which containers keep small), made by the front for each worker process and
passed to it at spawn.

Ownership is one-way: the worker places (`ArenaWriter.place`), the front hands out views and
tells the worker when the last view of a block is gone (`ArenaReader`, a ("free", offsets)
message), and only then does the worker reuse the block. A full arena is not an error: the
buffer travels in the frame as before.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np

# Virtual size of each worker's arena; pages are only backed once written (the high-water mark
# of the answers the front holds at once), and a full arena falls back to the socket.
ARENA_BYTES = 1 << 30
_ALIGN = 64


def create_arena(size: int = ARENA_BYTES) -> int | None:
    """A new memfd of `size` bytes, or None where the system has no memfd (the socket path then
    carries everything). Close-on-exec: only the worker it is passed to (`pass_fds`) inherits it."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        fd = os.memfd_create("proctor-arena")
        os.ftruncate(fd, size)
    except OSError:
        return None
    return fd


class ArenaWriter:
    """The worker's side: first-fit placement of buffers in the arena, blocks freed by the front."""

    def __init__(self, fd: int) -> None:
        self.size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.size)
        os.close(fd)  # the mapping keeps the memory; the fd was ours to close
        self._view = memoryview(self._map)
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}  # offset -> size of blocks the front still holds

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def place(self, data: memoryview) -> int | None:
        """Copy `data` into a free block; its offset, or None when no block is large enough."""
        size = -(-data.nbytes // _ALIGN) * _ALIGN or _ALIGN
        for index, (offset, room) in enumerate(self._free):
            if room >= size:
                if room == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, room - size)
                self._used[offset] = size
                self._view[offset : offset + data.nbytes] = data.cast("B")
                return offset
        return None

    def free(self, offsets: list[int]) -> None:
        """Blocks the front is done with become free again (merged with free neighbours)."""
        for offset in offsets:
            size = self._used.pop(offset, None)
            if size is None:
                continue
            index = bisect.bisect(self._free, (offset, 0))
            if index < len(self._free) and self._free[index][0] == offset + size:  # the next block
                size += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == offset:  # the previous block
                offset, before = self._free.pop(index - 1)
                size += before
                index -= 1
            self._free.insert(index, (offset, size))


class ArenaReader:
    """The front's side: views of placed blocks; when a view's last user drops it, the block is
    reported free to the worker (batched: one message per event-loop turn; `report` drops it
    once the worker's channel is closed)."""

    def __init__(self, fd: int, report: Callable[[list[int]], None]) -> None:
        self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        os.close(fd)  # the mapping keeps the memory; the fd was ours to close
        self._report = report
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._pending: list[int] = []
        self.blocks_read = 0  # blocks handed out as views
        self.blocks_held = 0  # of which still in use here (not yet reported free)

    def view(self, offset: int, length: int) -> memoryview:
        """The block at `offset`, read-only (a memoryview, as a buffer read from the socket is);
        freed once it and every view made of it are gone."""
        array = np.frombuffer(self._map, dtype=np.uint8, count=length, offset=offset)
        array.flags.writeable = False
        weakref.finalize(array, self._released, offset).atexit = False  # nothing to free at exit
        self.blocks_read += 1
        self.blocks_held += 1
        return memoryview(array)

    def _released(self, offset: int) -> None:
        """May run on any thread (an answer can be encoded off the loop)."""
        if self._loop.is_closed():  # the worker (and its arena) went with it
            return
        if threading.get_ident() == self._loop_thread:  # the usual case, and no wake-up to pay
            self._queue(offset)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(self._queue, offset)

    def _queue(self, offset: int) -> None:
        self.blocks_held -= 1
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(offset)

    def _flush(self) -> None:
        offsets, self._pending = self._pending, []
        if offsets:
            self._report(offsets)
