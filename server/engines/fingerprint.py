"""Digests of a model directory: `model_fingerprint`, so a client can tell that two answers
(or an answer and a cached unembedding) came from the same teacher weights and tokenizer;
`tokenizer_fingerprint`, of the tokenizer alone, so a client that turns text into ids itself
(`proctor score --text`) can prove it holds the teacher's tokenizer; and `model_architecture`, a
label of the weight layout alone (teachers with equal labels can share devices by swapping weights).

Small files are hashed whole. Weight files of more than `full_hash_limit` bytes are hashed by
their size, their safetensors header (names, dtypes, shapes, offsets) and evenly spaced
samples of their contents: reading a 60 GB checkpoint at every start would cost minutes,
while any re-trained or re-quantised checkpoint changes the header or the sampled bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_META_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "preprocessor_config.json",
    "chat_template.jinja",
)
# What decides how text becomes ids (and ids text): the vocabulary, merges, added and special
# tokens, normalisation and the BOS/EOS settings. Not the chat template, config or processors.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 16


def _hash_large(path: Path, digest: hashlib._Hash) -> None:
    size = path.stat().st_size
    digest.update(str(size).encode())
    with path.open("rb") as handle:
        if path.suffix == ".safetensors":
            header_len = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(min(header_len, 64 << 20)))
        for index in range(_SAMPLES):
            handle.seek(max(0, (size - _SAMPLE_BYTES) * index // max(1, _SAMPLES - 1)))
            digest.update(handle.read(_SAMPLE_BYTES))


def model_fingerprint(model_dir: str | Path, *, full_hash_limit: int = 1 << 30) -> str:
    """sha256 (hex, 16 chars) over the config, tokenizer and weights of model_dir."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    files = sorted(
        p for p in root.iterdir() if p.is_file() and (p.name in _META_FILES or p.suffix in _WEIGHT_SUFFIXES)
    )
    for path in files:
        digest.update(path.name.encode())
        if path.suffix in _WEIGHT_SUFFIXES and path.stat().st_size > full_hash_limit:
            _hash_large(path, digest)
        else:
            with path.open("rb") as handle:
                for block in iter(lambda h=handle: h.read(8 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """sha256 (hex, 16 chars) over the tokenizer files of model_dir; "" when it has none.

    Files, not a loaded tokenizer: the same files are the same tokenizer on both sides whatever
    transformers release reads them, and a differing file is a match not proven (the caller
    refuses rather than guesses)."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        path = root / name
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16] if found else ""


def model_architecture(model_path: str) -> str | None:
    """A label for a checkpoint's weight layout (teachers with equal labels can swap weights)."""
    config_file = Path(model_path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    volatile = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}
    stable = {k: v for k, v in config.items() if k not in volatile}
    digest = hashlib.sha1(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:8]
    shape = "/".join(
        str(config.get(k, "?")) for k in ("num_hidden_layers", "hidden_size", "vocab_size")
    )
    return f"{config.get('model_type', 'model')}[{shape}]#{digest}"
