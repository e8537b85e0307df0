"""A byte-level tokenizer's vocabulary as bytes: every id's exact bytes, and text bytes back to ids.

Why bytes and not text: a character of several UTF-8 bytes is often split across byte-level
tokens, and a sampled response may even hold bytes that are not UTF-8 at all. Decoding ids to
text would turn those into U+FFFD and lose them; decoding each id to its bytes (the byte-level
alphabet maps each of the 256 byte values to one printable character) is exact, so the
response's bytes are what the student sampled, and both tokenizations are compared on them.

Only byte-level tokenizers (GPT-2's alphabet: Qwen, Llama 3, GPT-NeoX, ...) are taken; any
other is refused when it is loaded (`NotByteLevel`), never approximated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

# Invalid UTF-8 bytes after decoding with surrogateescape: U+DC80..U+DCFF, one per byte.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


class NotByteLevel(ValueError):
    """The tokenizer's pieces are not byte-level, so its ids cannot be decoded byte-exactly."""


def _byte_alphabet() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): printable bytes stand for themselves, the other 68
    values for the code points 256, 257, ... in byte order. Character -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for value in range(256):
        if value not in chars:
            chars[value] = chr(256 + extra)
            extra += 1
    return {char: value for value, char in chars.items()}


BYTE_OF_CHAR = _byte_alphabet()


def _decoder_is_byte_level(backend: Any) -> bool:
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", ())]
    return "ByteLevel" in kinds


@dataclass(frozen=True)
class TokenBytes:
    """One tokenizer's vocabulary as bytes, and its tokenizing of bytes.

    `pieces[i]` is id i's bytes (b"" for an id the tokenizer does not define); `special[i]` says
    whether id i is an added (special) token, whose bytes are its text; `lengths` their sizes.
    """

    pieces: tuple[bytes, ...]
    special: np.ndarray  # bool [V]
    lengths: np.ndarray  # int64 [V]
    byte_ids: np.ndarray  # int64 [256]: the id of each single byte's own token (-1: none)
    backend: Any  # the `tokenizers.Tokenizer` that tokenizes text for this vocabulary
    flat: np.ndarray  # uint8: every id's bytes one after another
    offsets: np.ndarray  # int64 [V]: where id i's bytes start in `flat`
    # The same tokenizer with its special tokens' text split as ordinary text: a student's plain
    # "<|im_end|>" must stay plain text for the teacher, never become its special token.
    plain_backend: Any = None

    @classmethod
    def of(cls, tokenizer: Any) -> TokenBytes:
        """The table of a transformers fast tokenizer; NotByteLevel when its pieces are not bytes."""
        backend = tokenizer.backend_tokenizer
        if not _decoder_is_byte_level(backend):
            raise NotByteLevel("its decoder is not byte-level, so its ids cannot be decoded to exact bytes")
        size = len(tokenizer)
        added = {index: token.content for index, token in tokenizer.added_tokens_decoder.items()}
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        pieces: list[bytes] = []
        for index, token in enumerate(tokens):
            if index in added:
                pieces.append(added[index].encode("utf-8"))
            elif token is None:
                pieces.append(b"")
            else:
                try:
                    pieces.append(bytes(BYTE_OF_CHAR[char] for char in token))
                except KeyError as exc:
                    raise NotByteLevel(f"id {index} ({token!r}) holds a character outside the byte-level "
                                       "alphabet") from exc
        special = np.zeros(size, dtype=bool)
        special[[i for i in added if i < size]] = True
        byte_ids = np.full(256, -1, dtype=np.int64)
        for index, piece in enumerate(pieces):
            if len(piece) == 1 and not special[index] and byte_ids[piece[0]] < 0:
                byte_ids[piece[0]] = index
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=size)
        flat = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        plain = type(backend).from_str(backend.to_str())
        plain.encode_special_tokens = True
        return cls(tuple(pieces), special, lengths, byte_ids, backend, flat, offsets, plain)

    @property
    def size(self) -> int:
        return len(self.pieces)

    def decode(self, ids: np.ndarray) -> bytes:
        """The exact bytes of `ids` (each known to be in range), gathered in one numpy pass."""
        lengths = self.lengths[ids]
        ends = np.cumsum(lengths)
        # Byte j of the output is byte (j - start of its token in the output) of its token's piece.
        shift = np.repeat(self.offsets[ids] - (ends - lengths), lengths)
        return self.flat[shift + np.arange(len(shift))].tobytes()

    def encode(self, data: bytes, *, specials: bool = True) -> np.ndarray:
        """`data` tokenized as this tokenizer tokenizes text (special tokens recognised unless
        `specials` is False): its valid UTF-8 runs by the tokenizer, each byte that is not UTF-8
        by its own single-byte token. ValueError when the tokens do not spell `data` back (a
        normalizer that changes the text, or a byte without a token of its own)."""
        text = data.decode("utf-8", errors="surrogateescape")
        parts: list[list[int]] = []
        start = 0
        for bad in _ESCAPED_BYTE.finditer(text):
            if bad.start() > start:
                parts.append(self.encode_text(text[start:bad.start()], specials=specials))
            byte = ord(bad.group()) - 0xDC00
            if self.byte_ids[byte] < 0:
                raise ValueError(f"byte 0x{byte:02x} has no token of its own in this vocabulary")
            parts.append([int(self.byte_ids[byte])])
            start = bad.end()
        if start < len(text):
            parts.append(self.encode_text(text[start:], specials=specials))
        ids = np.concatenate([np.asarray(part, dtype=np.int64) for part in parts]) if parts else np.zeros(0, np.int64)
        if self.decode(ids) != data:
            raise ValueError("the tokenizer does not spell the text back byte for byte (its normalizer changes it)")
        return ids

    def encode_text(self, text: str, *, specials: bool = True) -> list[int]:
        """`text` as this tokenizer tokenizes it (none added; special tokens recognised unless
        `specials` is False, then their text is split as any other)."""
        backend = self.backend if specials or self.plain_backend is None else self.plain_backend
        return backend.encode(text, add_special_tokens=False).ids

    def special_texts(self) -> list[str]:
        """The text of every special (added) token, longest first."""
        return sorted({self.pieces[i].decode("utf-8", "replace") for i in np.flatnonzero(self.special)
                       if self.pieces[i]}, key=len, reverse=True)
