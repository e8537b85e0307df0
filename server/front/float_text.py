"""float32 values as JSON number text, written by numpy column-wise: no Python runs per value.

Why: formatting a float is the JSON answer's main cost. `json.dumps` writes a float32 score as
the shortest repr of its float64 widening (17 significant digits, ~0.5 µs a value in CPython's
dtoa), so a [R, 64] score_ids answer cost the front tens of µs a row, more than the whole
gRPC path. Here each value becomes 9 significant digits (FLT_DECIMAL_DIG: the text reads back as
the same float32, exactly) by integer arithmetic on arrays, laid out as bytes through a gather
from a small per-value alphabet, and the kept bytes of every value are taken in one mask.

Layout: fixed notation for decimal exponents -5..8 (`-0.000123456789`, `-12.3456789`,
trailing zeros dropped, at least one fraction digit: `-5.0`), scientific beyond (`1.5e-07`); a
value that is not finite is `null` (JSON has no NaN or infinity: padded score_ids are -inf).
"""

from __future__ import annotations

import functools

import numpy as np

_DIGITS = 9  # significant digits that round-trip every float32
_FIXED = range(-5, 9)  # decimal exponents written without an exponent part
# The alphabet a value's text is gathered from: its 9 digits, then constant characters, then
# its exponent's two digits.
_D0, _POINT, _ZERO, _MINUS, _E, _N, _U, _L, _COMMA, _CLOSE, _OPEN, _X0 = 0, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19
_CONST = np.frombuffer(b".0-enul,][", dtype=np.uint8)
# Output slots a value may use: three of separator (`],[` between rows, `,` within), the sign,
# then up to 16 characters.
_SEP, _SIGN, _WIDTH = 3, 3, 20
_EXPONENTS = range(-46, 40)  # every decimal exponent a nonzero float32 can have
# Which separator slots a value keeps: none (the first), a comma, or a row break.
_SEPARATORS = np.array([[False, False, False], [False, True, False], [True, True, True]])


@functools.cache
def _layouts() -> tuple[np.ndarray, np.ndarray]:
    """Per (decimal exponent, trailing zeros of the 9 digits): the alphabet index of each output
    slot and whether the slot is kept (the separator and sign slots are decided per value)."""
    index = np.zeros((len(_EXPONENTS), _DIGITS, _WIDTH), dtype=np.intp)
    keep = np.zeros((len(_EXPONENTS), _DIGITS, _WIDTH), dtype=bool)
    for e_row, exponent in enumerate(_EXPONENTS):
        for zeros in range(_DIGITS):
            significant = _DIGITS - zeros  # digits kept, >= 1
            if exponent in _FIXED:
                if exponent >= 0:
                    fraction = list(range(exponent + 1, significant)) or [_ZERO]
                    chars = [*range(exponent + 1), _POINT, *fraction]
                else:
                    chars = [_ZERO, _POINT] + [_ZERO] * (-exponent - 1) + list(range(significant))
            else:
                mantissa = [0, _POINT] + (list(range(1, significant)) or [_ZERO])
                chars = mantissa + [_E] + ([_MINUS] if exponent < 0 else []) + [_X0, _X0 + 1]
            slots = [_CLOSE, _COMMA, _OPEN, _MINUS, *chars]
            index[e_row, zeros, : len(slots)] = slots
            keep[e_row, zeros, : len(slots)] = True
    return index, keep


_NULL = np.array([_CLOSE, _COMMA, _OPEN, _MINUS, _N, _U, _L, _L] + [0] * (_WIDTH - 8), dtype=np.intp)
_NULL_KEEP = np.array([True] * 3 + [False] + [True] * 4 + [False] * (_WIDTH - 8))


def _text(values: np.ndarray, separators: np.ndarray) -> str:
    """Each value's text preceded by its separator (`separators`: per value, 0 none, 1 a comma,
    2 a row break `],[`), concatenated."""
    x = values.astype(np.float64).ravel()
    count = x.shape[0]
    finite = np.isfinite(x)
    magnitude = np.where(finite, np.abs(x), 1.0)
    zero = magnitude == 0
    magnitude[zero] = 1.0
    exponent = np.floor(np.log10(magnitude)).astype(np.int64)
    digits = np.rint(magnitude * 10.0 ** (_DIGITS - 1 - exponent))
    for _ in range(2):  # log10 is off by one near powers of ten, and rounding may carry: fix both
        high, low = digits >= 10**_DIGITS, digits < 10 ** (_DIGITS - 1)
        if not (high.any() or low.any()):
            break
        exponent += high.astype(np.int64) - low.astype(np.int64)
        digits = np.rint(magnitude * 10.0 ** (_DIGITS - 1 - exponent))
    number = digits.astype(np.int64)
    number[zero] = 0
    exponent[zero] = 0
    powers = 10 ** np.arange(_DIGITS - 1, -1, -1, dtype=np.int64)
    column = (number[:, None] // powers) % 10  # [N, 9] decimal digits
    zeros = np.zeros(count, dtype=np.intp)
    trailing = np.ones(count, dtype=bool)
    for place in range(_DIGITS - 1, 0, -1):  # trailing zeros, at most 8 (one digit is always kept)
        trailing &= column[:, place] == 0
        zeros += trailing
    alphabet = np.empty((count, _X0 + 2), dtype=np.uint8)
    alphabet[:, :_DIGITS] = column + ord("0")
    alphabet[:, _POINT:_X0] = _CONST
    shown = np.abs(exponent)
    alphabet[:, _X0] = shown // 10 + ord("0")
    alphabet[:, _X0 + 1] = shown % 10 + ord("0")
    table, kept = _layouts()
    row = np.clip(exponent - _EXPONENTS.start, 0, len(_EXPONENTS) - 1)
    index = table[row, zeros]
    keep = kept[row, zeros]
    if not finite.all():
        index[~finite] = _NULL
        keep[~finite] = _NULL_KEEP
    keep[:, _SIGN] = np.signbit(x) & finite
    keep[:, :_SEP] = _SEPARATORS[separators]
    return np.take_along_axis(alphabet, index, axis=1)[keep].tobytes().decode("ascii")


def json_items(values: np.ndarray) -> str:
    """A [R] array as JSON list items (`a,b,c`) or a [R, K] one as rows (`[a,b],[c,d]`), without
    the enclosing list's brackets; non-finite values are null."""
    values = np.asarray(values)
    if values.ndim == 1:
        separators = np.ones(values.shape[0], dtype=np.intp)
        separators[:1] = 0
        return _text(values, separators)
    rows, width = values.shape
    if not rows:
        return ""
    if not width:
        return ",".join(["[]"] * rows)
    separators = np.ones((rows, width), dtype=np.intp)
    separators[:, 0] = 2
    separators[0, 0] = 0
    return "[" + _text(values, separators.ravel()) + "]"
