"""JSON from untrusted peers, parsed with bounds so that hostile input is a 422, not a 500.

`json.loads` alone fails on hostile input in ways that surface as internal errors: deep
nesting recurses until RecursionError, an integer of thousands of digits trips Python's
int-string conversion limit (a bare ValueError), and a `\\ud800` escape yields a string
with a lone UTF-16 surrogate that no UTF-8 encoder (protobuf, a tokenizer, a log line)
accepts later. `loads_bounded` checks each of these and raises `invalid(field, ...)`, the
contract's INVALID_ARGUMENT naming the field.

Depth is checked by a pre-scan before parsing (bracket nesting outside strings), so that
the recursive C parser never starts on a document deeper than allowed; catching
RecursionError would leave the depth limit to the interpreter's stack instead.

The same pre-scan counts the numbers outside strings when the caller passes `max_numbers` (the
most its teachers could use: `ScoringService.most_body_numbers`), so that a body of millions of
ids is refused after a scan of its first megabyte, never parsed or converted (issue 43: 50 MB of
ids took 4 s of parsing before the size rule refused them).

Numbers go through Python-level hooks: besides bounding integers, a Python call per
number lets the interpreter hand the GIL to other threads while a large body is parsed in a
worker thread (a bare `json.loads` holds the GIL for the whole document, so a thread alone
does not keep the event loop responsive). That about doubles the CPU time of a number-heavy
document (~2 s for 50 MB of token ids), a price paid only by bodies that should have been
protobuf; small documents barely notice.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from proctor.server.common.errors import invalid

BODY = "body"
DEFAULT_MAX_DEPTH = 64
# 20 digits hold every 64-bit integer; anything longer is out of range for every integer
# field of the wire contract, and is refused before Python converts it.
MAX_INT_DIGITS = 20

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
# `byte | 0x20` maps "[" to "{" and "]" to "}" and no other byte onto either.
_OPENING, _CLOSING = ord("{"), ord("}")
_SCAN_CHUNK = 1 << 20
# A `\u` escape of a UTF-16 surrogate (D800-DFFF); only then can a parsed string hold one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _utf8_text(text: str | bytes, field: str) -> str:
    """The document as text; JSON between systems is UTF-8 (RFC 8259, section 8.1)."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(field, f"has a character that is not valid Unicode at offset {exc.start}") from None
        return text
    try:
        return bytes(text).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(field, f"is not UTF-8 (byte {exc.start} is not valid)") from None


# A number token starts with a digit or "-" right after one of these (outside strings, in JSON).
_NUMBER_START = np.zeros(256, dtype=bool)
_NUMBER_START[list(b"-0123456789")] = True
_BEFORE_NUMBER = np.zeros(256, dtype=bool)
_BEFORE_NUMBER[list(b"[,: \t\r\n")] = True


@dataclass
class _Scan:
    """What one chunk of the pre-parse scan hands the next."""

    in_string: bool = False
    backslashes: int = 0  # length of the backslash run that ended the previous chunk
    depth: int = 0
    deepest: int = 0
    count_numbers: bool = False
    numbers: int = 0  # number tokens outside strings so far (when count_numbers)
    last: int = ord(" ")  # the previous chunk's last byte

    def quotes(self, chunk: np.ndarray) -> np.ndarray:
        """Positions of the quotes that open or close a string (those not escaped by an odd
        run of backslashes), and the backslash run left at the chunk's end."""
        quotes = np.flatnonzero(chunk == _QUOTE)
        plain = np.flatnonzero(chunk != _BACKSLASH) if quotes.size or chunk[-1] == _BACKSLASH else None
        carried, self.backslashes = self.backslashes, _trailing_run(plain, len(chunk), self.backslashes)
        if not quotes.size:
            return quotes
        before = np.searchsorted(plain, quotes) - 1  # the last non-backslash before each quote
        run = quotes - 1 - np.where(before >= 0, plain[np.maximum(before, 0)], -1 - carried)
        return quotes[run % 2 == 0]

    def feed(self, chunk: np.ndarray) -> None:
        quotes = self.quotes(chunk)
        if self.count_numbers:
            self._count(chunk, quotes)
        folded = chunk | 0x20
        brackets = np.flatnonzero((folded == _OPENING) | (folded == _CLOSING))
        if brackets.size:
            inside = (np.searchsorted(quotes, brackets) + self.in_string) % 2 == 1
            outside = folded[brackets[~inside]]
            if outside.size:
                running = np.cumsum(np.where(outside == _OPENING, 1, -1), dtype=np.int64) + self.depth
                self.deepest = max(self.deepest, int(running.max()))
                self.depth = int(running[-1])
        self.in_string ^= bool(quotes.size % 2)


    def _count(self, chunk: np.ndarray, quotes: np.ndarray) -> None:
        """Count the number tokens that start in this chunk outside strings."""
        before = np.empty_like(chunk)
        before[0], before[1:] = self.last, chunk[:-1]
        starts = np.flatnonzero(_NUMBER_START[chunk] & _BEFORE_NUMBER[before])
        self.last = int(chunk[-1])
        if starts.size:
            inside = (np.searchsorted(quotes, starts) + self.in_string) % 2 == 1
            self.numbers += int(starts.size - np.count_nonzero(inside))


def _trailing_run(plain: np.ndarray | None, length: int, carried: int) -> int:
    """Backslashes at the end of a chunk whose non-backslash positions are `plain`
    (None: the chunk does not end in one)."""
    if plain is None:
        return 0
    if not plain.size:
        return carried + length
    return length - 1 - int(plain[-1])


def _prescan(data: bytes, depth_limit: int, number_limit: int | None) -> _Scan:
    """One pass over the raw bytes before any parse: the bracket nesting depth outside strings and,
    with `number_limit`, the number tokens outside strings; it stops as soon as either is past its
    limit, so that an oversized body costs the scan of its first chunks only. Vectorised (numpy
    releases the GIL), linear in the size, chunked to bound memory. Escapes outside strings are
    invalid JSON, so a document that could mislead the string tracking is refused by the parser
    before it nests deeper or holds more numbers than counted here."""
    scan = _Scan(count_numbers=number_limit is not None)
    for start in range(0, len(data), _SCAN_CHUNK):
        scan.feed(np.frombuffer(data, np.uint8, min(_SCAN_CHUNK, len(data) - start), start))
        if scan.deepest > depth_limit or (number_limit is not None and scan.numbers > number_limit):
            break
    return scan


def nesting_depth(data: bytes, limit: int) -> int:
    """The bracket nesting depth of a JSON document outside its strings, stopping early past
    `limit` (`_prescan`)."""
    return _prescan(data, limit, None).deepest


def _number_hooks(field: str) -> dict[str, Any]:
    """parse_int / parse_float / parse_constant hooks that refuse what the contract cannot use."""

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise invalid(field, f"has an integer of {len(digits)} digits (at most {MAX_INT_DIGITS})")
        return int(digits)

    def parse_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise invalid(field, f"has the number {text[:40]} which overflows a float")
        return value

    def parse_constant(name: str) -> float:
        raise invalid(field, f"has {name}, which is not JSON")

    return {"parse_int": parse_int, "parse_float": parse_float, "parse_constant": parse_constant}


def _lone_surrogate_path(value: Any) -> list[str | int] | None:
    """The path (keys and indices) to the first key or string holding a lone surrogate, else
    None. Iterative, so the document's depth is no concern here."""
    stack: list[tuple[list[str | int], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            stack.extend(([*path, key], entry) for key, child in item.items() for entry in (key, child))
        elif isinstance(item, list):
            stack.extend(([*path, index], child) for index, child in enumerate(item))
    return None


def _field_at(field: str, path: list[str | int]) -> str:
    """`field` extended by a path inside it ("mm_processor_kwargs.size[0]"). The keys of a
    whole request body are the request's own fields, so they stand alone."""
    name = "" if field == BODY else field
    for step in path:
        name += f"[{step}]" if isinstance(step, int) else (f".{step}" if name else str(step))
    return name or field


def loads_bounded(text: str | bytes, *, max_depth: int = DEFAULT_MAX_DEPTH, field: str = BODY,
                  max_numbers: int | None = None) -> Any:
    """Parse untrusted JSON; raise ScoringError (INVALID_ARGUMENT naming `field`) when it is
    not UTF-8 or not JSON, nests deeper than max_depth, holds more than `max_numbers` numbers
    (counted on the raw bytes before anything is decoded or parsed: a body of millions of ids
    for a teacher of a few thousand tokens is refused in milliseconds; a surface passes the bound
    its teachers allow, `ScoringService.most_body_numbers`), has an integer longer than 20 digits,
    a non-finite number, or a string with a lone UTF-16 surrogate (then the error names the
    key inside the document that holds it)."""
    data = text if isinstance(text, bytes) else bytes(text) if not isinstance(text, str) else (
        text.encode("utf-8", "surrogatepass"))
    scan = _prescan(data, max_depth, max_numbers)
    if max_numbers is not None and scan.numbers > max_numbers:
        raise invalid(field, f"holds more than {max_numbers} numbers, more than any request the teachers here "
                      "serve can use (token ids up to the longest teacher's length)")
    document = _utf8_text(text, field)
    if scan.deepest > max_depth:
        raise invalid(field, f"nests deeper than {max_depth} levels")
    try:
        value = json.loads(document, **_number_hooks(field))
    except json.JSONDecodeError as exc:
        raise invalid(field, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:  # unreachable after the pre-scan; a guard, not the limit
        raise invalid(field, "nests too deeply") from None
    if document.find("\\") >= 0 and _SURROGATE_ESCAPE.search(document):  # find: a fast single-char scan
        path = _lone_surrogate_path(value)
        if path is not None:
            raise invalid(_field_at(field, path), "has a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)")
    return value
