"""The wire contract: stubs match the .proto, and the tensor codec round-trips every dtype."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from proctor.proto import decode_tensor, encode_tensor, iter_row_chunks, scoring_pb2
from proctor.proto.codec import decode_numpy

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_the_proto(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"})
    for name in ("scoring_pb2.py", "scoring_pb2.pyi", "scoring_pb2_grpc.py"):
        assert (tmp_path / name).read_bytes() == (ROOT / "proto" / name).read_bytes(), (
            f"proto/{name} is stale: run scripts/gen_proto.sh"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64])
def test_torch_round_trip_is_exact(dtype):
    value = (torch.randn(7, 5) * 100).to(dtype)
    wire = encode_tensor(value, first_row=3)
    back = decode_tensor(wire)
    assert back.dtype == dtype and back.shape == value.shape and wire.first_row == 3
    assert torch.equal(back, value)


def test_bfloat16_travels_in_two_bytes_per_value():
    wire = encode_tensor(torch.ones(4, 8, dtype=torch.bfloat16))
    assert wire.dtype == scoring_pb2.BFLOAT16 and len(wire.data) == 4 * 8 * 2


def test_numpy_round_trip_and_zero_copy_decode():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    wire = encode_tensor(array)
    view = decode_numpy(wire)
    assert np.array_equal(view, array)
    # A view over the message's bytes object, not a copy of it.
    assert not view.flags.writeable and not view.flags.owndata and isinstance(view.base.base, bytes)
    tensor = decode_tensor(wire)
    assert torch.equal(tensor, torch.from_numpy(array)) and tensor.untyped_storage().nbytes() == array.nbytes


def test_non_contiguous_tensors_encode_in_row_major_order():
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(decode_tensor(encode_tensor(value)), value)


def test_decode_rejects_inconsistent_messages():
    wire = encode_tensor(torch.zeros(2, 3))
    wire.shape[:] = [2, 4]
    with pytest.raises(ValueError, match="bytes"):
        decode_tensor(wire)
    wire.dtype = scoring_pb2.DTYPE_UNSPECIFIED
    with pytest.raises(ValueError, match="dtype"):
        decode_tensor(wire)


def test_row_chunks_are_whole_rows_that_reassemble():
    value = torch.randn(1000, 33)
    pieces = list(iter_row_chunks(value, first_row=5, target_bytes=4096))
    assert all(p.shape[1] == 33 for p in pieces)
    assert [p.first_row for p in pieces][:2] == [5, 5 + pieces[0].shape[0]]
    assert torch.equal(torch.cat([decode_tensor(p) for p in pieces]), value)


async def test_frames_split_anywhere_reassemble_and_truncation_is_detected():
    from proctor.proto import scoring_pb2
    from proctor.proto.framing import frame, read_frames

    messages = [scoring_pb2.TensorChunk(fingerprint=f"f{i}", tensor=encode_tensor(torch.randn(i + 1, 3))) for i in range(5)]
    stream = b"".join(frame(m) for m in messages)

    async def pieces(data: bytes, size: int):
        for start in range(0, len(data), size):
            yield data[start : start + size]

    for size in (1, 7, len(stream)):
        got = [m async for m in read_frames(pieces(stream, size), scoring_pb2.TensorChunk)]
        assert got == messages
    with pytest.raises(ValueError, match="inside a frame"):
        [m async for m in read_frames(pieces(stream[:-3], 64), scoring_pb2.TensorChunk)]
