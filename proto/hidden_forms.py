"""The wire forms of hidden states, shared by server and client: names, row widths and the fp8 row rule.

Why a form: a teacher on its own node ships every scored token's last-layer hidden state, 4 bytes
(float32) or 2 (bf16) per dimension. The smaller forms are computed on the teacher's device, next to
its logits, so only they cross the network:

- ``fp8``: e4m3 with one float32 scale per row (``amax / 448``), ``H + 4`` bytes a row;
- ``projected``: ``h·P`` float32 ``[r]``, ``P [H, r]`` the teacher's projection (the top-r right
  singular vectors of its unembedding ``W``); the logits are rebuilt as ``(h·P)·(W·P)ᵀ``;
- ``projected_fp8``: ``h·P`` as fp8 rows, ``r + 4`` bytes a row.

fp8 rows travel as the wire dtype ``FLOAT8_E4M3_ROWS``: a uint8 tensor ``[R, D + 4]``, each row
its D e4m3 bytes then its scale, so a row and its scale are never apart (streamed chunks of whole
rows, shared-memory answers, copied prefix rows all keep them together). This module holds the one
quantisation rule (`quantize_rows`) and its inverse (`dequantize_rows`), device-agnostic torch.
"""

from __future__ import annotations

import torch

EXACT = ""  # the default: the teacher's own dtype, unchanged
FLOAT32, BFLOAT16, FP8, PROJECTED, PROJECTED_FP8 = "float32", "bfloat16", "fp8", "projected", "projected_fp8"
FORMS = (FLOAT32, BFLOAT16, FP8, PROJECTED, PROJECTED_FP8)
PROJECTED_FORMS = frozenset({PROJECTED, PROJECTED_FP8})
FP8_FORMS = frozenset({FP8, PROJECTED_FP8})
# e4m3's largest finite value (torch.float8_e4m3fn), and a row's scale's bytes (float32).
FP8_MAX = 448.0
SCALE_BYTES = 4
ROWS_DTYPE = torch.uint8  # fp8 rows' storage dtype: the codec maps it to FLOAT8_E4M3_ROWS


def row_bytes(form: str, hidden_size: int, rank: int, exact_itemsize: int) -> int:
    """Bytes one row of hidden states takes on the wire in `form` (`exact_itemsize`: the teacher dtype's)."""
    width = rank if form in PROJECTED_FORMS else hidden_size
    if form in FP8_FORMS:
        return width + SCALE_BYTES
    if form == BFLOAT16:
        return 2 * width
    if form in (FLOAT32, PROJECTED):
        return 4 * width
    return exact_itemsize * width


def is_fp8_rows(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds packed fp8 rows (uint8 [R, D + 4])."""
    return tensor.dtype == ROWS_DTYPE


def width(tensor: torch.Tensor) -> int:
    """The logical width D of a [R, D] hidden-state tensor, packed fp8 rows included."""
    return int(tensor.shape[-1]) - SCALE_BYTES if is_fp8_rows(tensor) else int(tensor.shape[-1])


def quantize_rows(values: torch.Tensor) -> torch.Tensor:
    """float rows [R, D] -> packed fp8 rows uint8 [R, D + 4] on the same device.

    Each row's scale is ``amax / 448`` (1 for an all-zero row), so its largest entry maps to e4m3's
    largest finite value and nothing saturates; the e4m3 cast rounds to nearest-even."""
    if values.dim() != 2:
        raise ValueError(f"quantize_rows takes [rows, D], got shape {tuple(values.shape)}")
    x = values.float()
    amax = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros((x.shape[0], 1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed fp8 rows uint8 [R, D + 4] -> [R, D] in `dtype` (float32 or float64: exact either way,
    since every e4m3 value and its product with a float32 scale is a float32 number)."""
    if not is_fp8_rows(packed) or packed.dim() != 2 or packed.shape[1] < SCALE_BYTES:
        raise ValueError(f"packed fp8 rows are uint8 [rows, D + {SCALE_BYTES}], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    d = packed.shape[1] - SCALE_BYTES
    values = packed[:, :d].contiguous().view(torch.float8_e4m3fn).to(dtype)
    scale = packed[:, d:].contiguous().view(torch.float32).to(dtype)
    return values * scale


def rebuilt(hidden: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Any form's rows as floats in `dtype` (packed fp8 rows dequantised; others cast)."""
    return dequantize_rows(hidden, dtype) if is_fp8_rows(hidden) else hidden.to(dtype)
