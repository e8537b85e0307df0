"""The stored forms of a teacher's rows, each with the error it states: ids bit-packed, log-probs
quantized.

Why these forms: at K=64 the common layout (int32 ids, float16 log-probs) costs 384 bytes a
position. Ids need only ceil(log2 V) bits; top-k log-probs need only what keeps the stored
distribution within ~1e-4 nats of the served one. Each form's largest error is a number a
reader can compute per row (`row_error`), which `proctor verify-dataset` checks a live teacher
against:

- ``f32``: the served float32 values, exact;
- ``f16``: IEEE half, relative error 2^-11 (absolute |x|·2^-11 per value);
- ``u8``: 8 bits per value on a per-row affine grid (offset = the row's smallest value, scale =
  its range / 255), absolute error at most scale / 2 (+ float32 rounding of the grid).

The sampled token's log-prob is always float32 (the sampled losses take differences of it).
Pure numpy: shared by the writer, the reader and the bench.
"""

from __future__ import annotations

import math

import numpy as np

TOPK_FORMS = ("u8", "f16", "f32")
MAIN_FORM = "u8"
_F16_RELATIVE = 2.0 ** -11
_F32_ABSOLUTE = 1e-6  # float32 rounding of the grid (|x| < 100 nats)


def id_bits(vocab_size: int) -> int:
    """The fewest bits that hold every id of a vocabulary of `vocab_size`."""
    return max(1, math.ceil(math.log2(max(2, vocab_size))))


_CHUNK = 1 << 16  # ids packed a chunk at a time (a multiple of 8: chunks end on whole bytes)


def pack_ids(ids: np.ndarray, bits: int) -> bytes:
    """Non-negative ids (any shape) as `bits`-bit fields, little-endian bit order, row-major."""
    flat = np.ascontiguousarray(ids, dtype="<u4").reshape(-1)
    if flat.size and int(flat.max()) >> bits:
        raise ValueError(f"an id ({int(flat.max())}) does not fit in {bits} bits")
    out = []
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start : start + _CHUNK].view(np.uint8).reshape(-1, 4)
        fields = np.unpackbits(chunk, axis=1, bitorder="little")[:, :bits]
        out.append(np.packbits(fields, bitorder="little").tobytes())
    return b"".join(out)


def unpack_ids(data: bytes, count: int, bits: int) -> np.ndarray:
    """`count` int32 ids from `pack_ids`' bytes."""
    fields = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * bits, bitorder="little")
    wide = np.zeros((count, 32), dtype=np.uint8)
    wide[:, :bits] = fields.reshape(count, bits)
    return np.packbits(wide, axis=1, bitorder="little").view("<u4").reshape(count).astype(np.int32)


def quantize_u8(values: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
    """[R, K] float log-probs → (uint8 codes, offset float32 [R], scale float32 [R])."""
    values = np.asarray(values, dtype=np.float32)
    if not np.isfinite(values).all():
        raise ValueError("the u8 form stores finite log-probs only; store this dataset with --topk-form f16 or f32")
    offset = values.min(axis=1)
    scale = (values.max(axis=1) - offset) / np.float32(255.0)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.rint((values - offset[:, None]) / safe[:, None]).clip(0, 255).astype(np.uint8)
    return codes.tobytes(), offset, scale


def dequantize_u8(data: bytes, shape: tuple[int, int], offset: np.ndarray, scale: np.ndarray) -> np.ndarray:
    codes = np.frombuffer(data, dtype=np.uint8).reshape(shape).astype(np.float32)
    return (np.asarray(offset, np.float32)[:, None] + codes * np.asarray(scale, np.float32)[:, None]).astype(np.float32)


def encode_topk_logprobs(values: np.ndarray, form: str) -> tuple[bytes, np.ndarray | None, np.ndarray | None]:
    """[R, K] log-probs in `form`: (bytes, offset, scale); offset and scale only for ``u8``."""
    if form == "u8":
        return quantize_u8(values)
    dtype = {"f16": "<f2", "f32": "<f4"}[form]
    return np.ascontiguousarray(values, dtype=dtype).tobytes(), None, None


def decode_topk_logprobs(data: bytes, shape: tuple[int, int], form: str, offset=None, scale=None) -> np.ndarray:
    """float32 [R, K] from `encode_topk_logprobs`' parts."""
    if form == "u8":
        return dequantize_u8(data, shape, offset, scale)
    dtype = {"f16": "<f2", "f32": "<f4"}[form]
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(np.float32)


def row_error(stored: np.ndarray, form: str, scale: np.ndarray | None = None) -> np.ndarray:
    """The stated largest |stored - served| of each value of float32 [R, K] `stored`."""
    if form == "u8":
        return np.broadcast_to(np.asarray(scale, np.float32)[:, None] / 2 + _F32_ABSOLUTE, stored.shape)
    if form == "f16":
        return np.abs(stored) * _F16_RELATIVE + _F32_ABSOLUTE
    return np.full(stored.shape, _F32_ABSOLUTE, dtype=np.float32)


def topk_kl(exact: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """Per row KL(exact ‖ stored) of the two [R, K] log-prob tables, each renormalised over its K
    ids, in float64: what storing a row in a lossy form costs a top-k loss."""
    p = np.asarray(exact, np.float64)
    q = np.asarray(stored, np.float64)
    p = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    q = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    return (np.exp(p) * (p - q)).sum(axis=1)
