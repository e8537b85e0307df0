"""The shared arena: the large buffers of a worker's replies reach the front through shared memory.

The placement, the reuse of freed blocks and the frame format are checked on a real memfd
mapped twice (as the front and the worker map it); the whole path through real replica
worker processes is checked against the float64 reference, with every block the front read
given back once its answer is sent. Freed pages above the warm part leave the memfd: its
resident size (`st_blocks` of the shared object, and this process's `RssShmem`) is measured.
"""

from __future__ import annotations

import asyncio
import gc
import mmap
import os

import httpx
import pytest
import torch

from proctor.proto import decode_tensor, scoring_pb2
from proctor.server.worker.arena import ArenaReader, ArenaWriter, create_arena, punch_hole
from proctor.server.worker.protocol import ARENA_MIN_BYTES, frame, parse
from proctor.server.worker.wire import EncodedResult, RawRows

from support.reference import reference_rows
from support.scoring import sequences
from support.servers import start_server, wait_for

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd on this system")


def _pair(size: int):
    """A writer and a reader over one memfd; the reader's free reports go straight to the writer."""
    fd = create_arena(size)
    writer = ArenaWriter(os.dup(fd))
    reader = ArenaReader(fd, writer.free)
    return writer, reader


def _resident(fd: int) -> int:
    """Bytes of the memfd backed by memory: the shared object's own pages, whoever mapped them."""
    return os.fstat(fd).st_blocks * 512


def _rss_shmem(pid: int | str = "self") -> int:
    """RssShmem of a process in bytes: the shared-memory pages mapped into it."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no RssShmem in /proc status")


def _body(parts) -> memoryview:
    return memoryview(b"".join(bytes(p) for p in parts[1:]))  # after the frame's length


def test_blocks_are_placed_first_fit_and_freed_blocks_merge_and_are_reused():
    async def run():
        writer, _ = _pair(1 << 20)
        data = memoryview(bytes(range(256)) * 1024)  # 256 KiB
        a, b, c = (writer.place(data) for _ in range(3))
        assert (a, b, c) == (0, 256 << 10, 512 << 10)
        assert writer.place(memoryview(bytes(300 << 10))) is None  # 256 KiB left: no room
        writer.free([b])
        writer.free([a])  # merges with b's block: one free 512 KiB block at 0
        assert writer.place(memoryview(bytes(500 << 10))) == 0
        writer.free([0, c, 12345])  # an offset never placed is ignored
        assert writer.used_bytes == 0 and writer.place(memoryview(bytes(1 << 20))) == 0

    asyncio.run(run())


def test_large_buffers_travel_in_the_arena_and_are_freed_when_their_views_go():
    async def run():
        writer, reader = _pair(4 << 20)
        rows = torch.randn(ARENA_MIN_BYTES // 8, 4)  # 2 * ARENA_MIN_BYTES of float32
        message = ("reply", 1, [EncodedResult(b"", RawRows.of(rows), None, first_row=1)])
        parts = frame(message, writer)
        assert sum(memoryview(p).nbytes for p in parts) < 1024  # the rows are not in the frame
        assert writer.used_bytes >= rows.numel() * 4
        back = parse(_body(parts), reader)[2][0]
        assert torch.equal(back.hidden_states, rows)
        assert reader.blocks_read == 1 and reader.blocks_held == 1
        del back
        gc.collect()
        await asyncio.sleep(0)  # the free report goes out on the loop's next turn
        assert reader.blocks_held == 0 and writer.used_bytes == 0

    asyncio.run(run())


def test_a_full_arena_sends_the_buffer_in_the_frame():
    async def run():
        writer, reader = _pair(ARENA_MIN_BYTES * 2)
        big = RawRows.of(torch.randn(ARENA_MIN_BYTES // 4 + 16))  # a bit more than ARENA_MIN_BYTES
        kept = parse(_body(frame(("reply", 1, big), writer)), reader)[2]  # in the arena, still held
        parts = frame(("reply", 2, big), writer)  # no room left beside the first
        assert sum(memoryview(p).nbytes for p in parts) > ARENA_MIN_BYTES
        again = parse(_body(parts), reader)[2]
        assert torch.equal(again.tensor(), big.tensor()) and torch.equal(kept.tensor(), big.tensor())
        assert reader.blocks_read == 1

    asyncio.run(run())


MiB = 1 << 20


@pytest.mark.parametrize("method", ["madvise", "fallocate"])
def test_freed_pages_above_the_warm_part_leave_the_memfd_and_later_blocks_read_back_right(method):
    """A burst of 96 MiB freed: the memfd falls back to the warm 8 MiB (both release methods),
    a block still held across the sweep keeps its bytes, and blocks placed in released space
    afterwards (fresh zero pages) read back right through the front's views."""
    async def run():
        fd = create_arena(256 * MiB)
        probe = os.dup(fd)  # st_blocks of the shared object, from outside the writer
        writer = ArenaWriter(os.dup(fd), keep_bytes=8 * MiB, release_min_bytes=4 * MiB, release=method)
        reader = ArenaReader(fd, writer.free)
        assert writer.release_method == method
        shmem_before = _rss_shmem()
        blocks = [writer.place(memoryview(bytes([i % 251 + 1]) * (MiB - 100))) for i in range(96)]
        held = blocks[60]  # not page-aligned: its first and last pages are shared with free neighbours
        assert held % mmap.PAGESIZE != 0
        burst = _resident(probe)
        assert burst >= 95 * MiB and _rss_shmem() - shmem_before >= 90 * MiB
        writer.free([b for b in blocks if b != held])
        assert writer.sweeps == 1  # one sweep for the whole batch of frees
        assert _resident(probe) <= 8 * MiB + 2 * MiB  # the warm part, and the held block's pages
        assert _rss_shmem() - shmem_before <= 12 * MiB
        assert bytes(reader.view(held, MiB - 100)) == bytes([60 % 251 + 1]) * (MiB - 100)
        writer.free([held])  # the arena is empty: everything above the warm part goes
        assert _resident(probe) <= 8 * MiB
        again = [bytes(range(i, i + 200)) * (5243 + i) for i in range(40)]  # ~1 MiB each, into released space
        offsets = [writer.place(memoryview(data)) for data in again]
        assert max(offsets) > 30 * MiB
        views = [reader.view(offset, len(data)) for offset, data in zip(offsets, again, strict=True)]
        assert all(bytes(v) == data for v, data in zip(views, again, strict=True))
        del views
        gc.collect()
        await asyncio.sleep(0)
        assert writer.used_bytes == 0 and _resident(probe) <= 8 * MiB
        writer.close()
        os.close(probe)

    asyncio.run(run())


def test_small_frees_wait_for_a_sweep_and_release_off_keeps_every_page():
    """Releasing is batched: a small block freed above the warm part while others are in use
    costs no sweep; and with releasing off (the control) the pages stay, so the figures above
    measure the release and not something else."""
    fd = create_arena(64 * MiB)
    probe = os.dup(fd)
    writer = ArenaWriter(fd, keep_bytes=MiB, release_min_bytes=8 * MiB)
    blocks = [writer.place(memoryview(bytes(256 << 10))) for _ in range(64)]  # 16 MiB
    writer.free(blocks[10:14])  # 1 MiB above the warm part
    assert writer.sweeps == 0 and _resident(probe) >= 16 * MiB
    writer.free(blocks[14:50])  # 10 MiB pending: one sweep
    assert writer.sweeps == 1 and _resident(probe) == 6 * MiB  # blocks 10..49 (2.5-12.5 MiB) went
    os.close(probe)

    fd = create_arena(64 * MiB)
    probe = os.dup(fd)
    kept = ArenaWriter(fd, keep_bytes=MiB, release_min_bytes=MiB, release="off")
    kept.free([kept.place(memoryview(bytes(MiB))) for _ in range(32)])
    assert kept.sweeps == 0 and _resident(probe) >= 32 * MiB
    os.close(probe)


def test_punch_hole_frees_pages_of_a_memfd_and_they_read_back_as_zeros():
    fd = create_arena(8 * MiB)
    with mmap.mmap(fd, 8 * MiB) as mapping:
        mapping[:] = b"\xff" * (8 * MiB)
        assert _resident(fd) == 8 * MiB
        punch_hole(fd, 2 * MiB, 4 * MiB)
        assert _resident(fd) == 4 * MiB and os.fstat(fd).st_size == 8 * MiB
        assert mapping[2 * MiB : 6 * MiB] == bytes(4 * MiB) and mapping[6 * MiB] == 0xFF
    os.close(fd)


def test_a_frame_naming_the_arena_needs_one():
    async def run():
        writer, _ = _pair(1 << 20)
        parts = frame(("reply", 1, RawRows.of(torch.randn(ARENA_MIN_BYTES))), writer)
        with pytest.raises(ConnectionError, match="shared arena"):
            parse(_body(parts), None)

    asyncio.run(run())


@pytest.fixture(scope="module")
def worker_server(tiny_model_dir):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=64, inference={"max_model_len": 1024})
    server = start_server(single_teacher_router(spec, name="tiny", replicas=1))
    yield server
    server.stop()


def test_answers_through_the_arena_equal_the_reference_and_every_block_comes_back(worker_server, tiny_model_dir):
    """400 tokens: top-64 (200 KB) and hidden states (100 KB) both large enough for the arena."""
    engine = worker_server.server.service.router.teachers["tiny"].replicas[0].engine
    arena = engine._channel.protocol.arena
    assert arena is not None
    before = arena.blocks_read
    for seed in (61, 62):
        ids = sequences(1, seed=seed, length=(400, 401))[0]
        ref = reference_rows(tiny_model_dir, ids)
        request = scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, topk=64, hidden_states=True)
        reply = httpx.post(worker_server.http_url + "/v1/score", content=request.SerializeToString(),
                           headers={"content-type": "application/x-protobuf"}, timeout=60)
        assert reply.status_code == 200
        answer = scoring_pb2.ScoreResponse.FromString(reply.content)
        torch.testing.assert_close(decode_tensor(answer.logprobs).double(), ref.logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(decode_tensor(answer.topk_logprobs).double(), ref.topk(64)[1], rtol=0, atol=1e-5)
        torch.testing.assert_close(decode_tensor(answer.hidden_states), ref.hidden_states, rtol=0, atol=1e-5)
    assert arena.blocks_read - before >= 4  # each answer's top-64 and hidden states came through it
    wait_for(lambda: arena.blocks_held == 0, timeout=10)  # and went back once the answers were sent
