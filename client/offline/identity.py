"""What a stored dataset is: the teacher, the settings and the input it was scored with.

One `DatasetIdentity` is written into every shard's Parquet metadata and the manifest; a job that
would append to a directory compares its own identity with the stored one field by field and
refuses, naming each field that differs, rather than mix two teachers' (or two K's) rows in one
dataset. Which fields must match is stated once here (`MUST_MATCH`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

METADATA_KEY = b"proctor"
FORMAT_VERSION = 1

# field -> how a refusal names it
MUST_MATCH = {
    "fingerprint": "teacher fingerprint",
    "topk": "K (--topk)",
    "temperature": "temperature",
    "topk_form": "top-k log-prob form",
    "logprobs": "sampled log-probs",
    "score_ids_column": "score_ids column",
    "hidden_form": "hidden-state form",
    "block_rows": "block rows",
    "input_fingerprint": "input dataset",
    "format": "shard format",
}


class IdentityMismatch(Exception):
    """A job asked to append to a dataset scored with something else; the message names it."""


def proctor_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("proctor")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class DatasetIdentity:
    """The teacher (`teacher`, `model`, `fingerprint`, `vocab_size`), what was stored (`topk`,
    `temperature` (None: 1), the top-k log-prob form, sampled log-probs, the score_ids column,
    the hidden-state form, "" for none) and the input (its fingerprint, rows and block size)."""

    teacher: str
    model: str
    fingerprint: str
    vocab_size: int
    topk: int
    temperature: float | None
    topk_form: str
    id_bits: int
    logprobs: bool
    score_ids_column: str
    hidden_form: str
    hidden_states: bool
    input_fingerprint: str
    input_rows: int
    block_rows: int
    proctor: str = ""
    format: int = FORMAT_VERSION

    @property
    def blocks(self) -> int:
        return -(-self.input_rows // self.block_rows)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> DatasetIdentity:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})

    def metadata(self, **extra) -> dict[bytes, bytes]:
        """Parquet key-value metadata: this identity and `extra` (a shard's block)."""
        return {METADATA_KEY: json.dumps({**self.to_json(), **extra}, sort_keys=True).encode()}

    def differences(self, stored: DatasetIdentity) -> list[str]:
        """Each field that must match and does not, as 'name: stored X, now Y'."""
        out = []
        for name, label in MUST_MATCH.items():
            before, now = getattr(stored, name), getattr(self, name)
            if before != now:
                out.append(f"{label}: stored {before!r}, now {now!r}")
        return out

    def check_append(self, stored: DatasetIdentity, where: str) -> None:
        problems = self.differences(stored)
        if problems:
            raise IdentityMismatch(
                f"refusing to append to {where}: it was scored with another setting ({'; '.join(problems)}). "
                "Write to a new --out, or remove the directory to rescore")


def identity_of_metadata(metadata: dict[bytes, bytes] | None) -> tuple[DatasetIdentity, dict]:
    """A shard's identity and its extra keys (block, rows) from its Parquet metadata."""
    if not metadata or METADATA_KEY not in metadata:
        raise ValueError("not a proctor shard: its Parquet metadata has no 'proctor' key")
    doc = json.loads(metadata[METADATA_KEY])
    identity = DatasetIdentity.from_json(doc)
    return identity, {k: v for k, v in doc.items() if k not in identity.to_json()}
