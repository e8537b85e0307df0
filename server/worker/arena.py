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

Memory is bounded after a burst: pages of a memfd, once written, stay resident until they are
given back, so a burst of large answers would leave a worker's arena at its high-water mark for
good. The writer therefore returns the pages of free space above its lowest `keep_bytes` to the
kernel (`madvise(MADV_REMOVE)` on its mapping, or `fallocate(PUNCH_HOLE)` on the memfd: either
frees the pages of the shared object itself, so they leave the front's mapping too). The low
region stays warm, since first-fit places there first and reusing warm pages (no fault, no
zeroing) is what the arena is for; releases are batched (`release_min_bytes` freed above the
warm region, or the arena empty) so that freeing one small block costs nothing. A block placed
later in a released region faults fresh zero pages and is written as any other.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import functools
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Literal

import numpy as np

# Virtual size of each worker's arena; pages are only backed once written (the high-water mark
# of the answers the front holds at once) and given back when freed above KEEP_BYTES, and a
# full arena falls back to the socket.
ARENA_BYTES = 1 << 30
_ALIGN = 64
# The lowest part of the arena kept resident when blocks are freed (first-fit reuses it first).
KEEP_BYTES = 32 << 20
# Free bytes above the warm part that accumulate before they are released in one sweep.
RELEASE_MIN_BYTES = 16 << 20
_PAGE = mmap.PAGESIZE
# linux/falloc.h
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

log = logging.getLogger(__name__)

ReleaseMethod = Literal["auto", "madvise", "fallocate", "off"]


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


@functools.cache
def _fallocate() -> Callable[..., int] | None:
    """libc's fallocate(2), or None where there is none (not Linux, no libc to load)."""
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fallocate.restype = ctypes.c_int
    return fallocate


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the pages of `fd` in [offset, offset + length) (its size unchanged; they read back
    as zeros): `fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`, which Python's `os` does
    not expose (`os.posix_fallocate` only allocates). OSError where the system refuses."""
    fallocate = _fallocate()
    if fallocate is None:
        raise OSError("no fallocate(2) on this system")
    if fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


class ArenaWriter:
    """The worker's side: first-fit placement of buffers in the arena, blocks freed by the front,
    and the pages of free space above `keep_bytes` given back to the kernel.

    One thread only (the worker's event loop places and frees). `release` picks how pages are
    given back: "auto" is `madvise(MADV_REMOVE)` where Python has it, else `fallocate`'s punch
    hole through libc (then the writer keeps the memfd open for it), else nothing.
    """

    def __init__(
        self,
        fd: int,
        *,
        keep_bytes: int = KEEP_BYTES,
        release_min_bytes: int = RELEASE_MIN_BYTES,
        release: ReleaseMethod = "auto",
    ) -> None:
        self.size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.size)
        self._view = memoryview(self._map)
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}  # offset -> size of blocks the front still holds
        self.keep_bytes = -(-keep_bytes // _PAGE) * _PAGE
        self.release_min_bytes = release_min_bytes
        self.release_method = self._pick_release(release)
        # fallocate needs the memfd itself; otherwise the mapping keeps the memory and the fd
        # was ours to close
        self._fd: int | None = fd if self.release_method == "fallocate" else None
        if self._fd is None:
            os.close(fd)
        # End of the highest block placed since the last sweep: nothing above it can be resident.
        self._top = 0
        self._unreleased = 0  # bytes freed above keep_bytes since the last sweep
        # Bytes of free space handed to the kernel so far (a range re-released without having
        # been written since counts again), and the sweeps that did it.
        self.released_bytes = 0
        self.sweeps = 0

    @staticmethod
    def _pick_release(release: ReleaseMethod) -> str | None:
        """"madvise", "fallocate", or None (pages are never given back)."""
        if release == "off":
            return None
        if release in ("auto", "madvise") and hasattr(mmap, "MADV_REMOVE"):
            return "madvise"
        if release == "madvise":
            raise ValueError("this Python has no mmap.MADV_REMOVE")
        if _fallocate() is not None:
            return "fallocate"
        if release == "fallocate":
            raise ValueError("this system has no fallocate(2)")
        return None

    def _give_back(self, start: int, length: int) -> None:
        """The pages of [start, start + length) (page-aligned, free) leave the shared object."""
        if self.release_method == "madvise":
            self._map.madvise(mmap.MADV_REMOVE, start, length)
        else:
            assert self._fd is not None
            punch_hole(self._fd, start, length)

    def close(self) -> None:
        """Drop the memfd kept for `fallocate` (the mapping goes with the writer)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

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
                self._top = max(self._top, offset + size)
                self._view[offset : offset + data.nbytes] = data.cast("B")
                return offset
        return None

    def free(self, offsets: list[int]) -> None:
        """Blocks the front is done with become free again (merged with free neighbours); once
        enough free space above the warm part has gathered, or nothing is in use, its pages are
        given back to the kernel (`release_free_pages`)."""
        for offset in offsets:
            size = self._used.pop(offset, None)
            if size is None:
                continue
            self._unreleased += max(0, offset + size - max(offset, self.keep_bytes))
            index = bisect.bisect(self._free, (offset, 0))
            if index < len(self._free) and self._free[index][0] == offset + size:  # the next block
                size += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == offset:  # the previous block
                offset, before = self._free.pop(index - 1)
                size += before
                index -= 1
            self._free.insert(index, (offset, size))
        if self.release_method is not None and self._unreleased and (
                self._unreleased >= self.release_min_bytes or not self._used):
            self.release_free_pages()

    def release_free_pages(self) -> int:
        """Give the whole pages of every free block above `keep_bytes` back to the kernel (only
        below the highest block placed since the last sweep: nothing above it was written).
        Pages shared with a block in use are kept. The bytes released (0 where this system
        cannot release; a refusal switches releasing off for good, the arena still works)."""
        released = 0
        if self.release_method is not None:
            top = -(-self._top // _PAGE) * _PAGE
            index = bisect.bisect(self._free, (self.keep_bytes, 0))
            if index > 0:
                index -= 1  # the block holding keep_bytes, if one does
            for offset, size in self._free[index:]:
                if offset >= top:
                    break
                start = max(-(-offset // _PAGE) * _PAGE, self.keep_bytes)
                end = min((offset + size) // _PAGE * _PAGE, top)
                if end <= start:
                    continue
                try:
                    self._give_back(start, end - start)
                except OSError as exc:
                    log.warning("shared arena: pages cannot be given back (%s); they stay resident", exc)
                    self.release_method = None
                    break
                released += end - start
        self._top = max((o + s for o, s in self._used.items()), default=0)
        self._unreleased = 0
        self.released_bytes += released
        self.sweeps += 1
        return released


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
