"""A stored dataset's directory: its shards, its manifest, and the resume rule.

The shards are the truth: a shard file exists only whole (`shards.write_shard` renames it into
place), so the blocks done are the shard files present, whatever a killed job's manifest said.
The manifest (``manifest.json``: the identity, every shard with its rows, positions and bytes,
and whether every block is done) is rewritten, atomically, from them after each shard.

Opening a directory for a job (`DatasetStore.open_for`) removes a killed job's temporary files,
and refuses, naming what differs, when the directory was scored with another identity.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from proctor.client.offline.identity import DatasetIdentity, identity_of_metadata
from proctor.client.offline.shards import TMP_SUFFIX, shard_name

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ShardEntry:
    block: int
    file: str
    rows: int
    positions: int  # scored rows (first_row..T-1) over the shard's sequences
    bytes: int


def _entry(path: Path) -> tuple[DatasetIdentity, ShardEntry]:
    meta = pq.read_metadata(path)
    identity, extra = identity_of_metadata(meta.metadata)
    positions = int(extra.get("positions", 0))
    return identity, ShardEntry(int(extra["block"]), path.name, meta.num_rows, positions, path.stat().st_size)


class DatasetStore:
    """The directory of one stored dataset."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.entries: dict[int, ShardEntry] = {}
        self.identity: DatasetIdentity | None = None

    @classmethod
    def read(cls, directory: Path | str) -> DatasetStore:
        """An existing dataset, as its shards say."""
        store = cls(directory)
        for path in sorted(store.directory.glob("shard-*.parquet")):
            identity, entry = _entry(path)
            store.identity = store.identity or identity
            store.entries[entry.block] = entry
        if store.identity is None:
            raise FileNotFoundError(f"{store.directory}: no shards (score one with `proctor score-dataset`)")
        return store

    @classmethod
    def open_for(cls, directory: Path | str, identity: DatasetIdentity) -> DatasetStore:
        """The directory ready for a job of `identity`: created, cleaned of temporary files,
        checked (`IdentityMismatch` naming what differs), its done blocks known."""
        store = cls(directory)
        store.directory.mkdir(parents=True, exist_ok=True)
        for tmp in store.directory.glob(f"*{TMP_SUFFIX}"):
            tmp.unlink()
        manifest = store.directory / MANIFEST
        if manifest.exists():
            identity.check_append(DatasetIdentity.from_json(json.loads(manifest.read_text())["identity"]),
                                  str(store.directory))
        for path in sorted(store.directory.glob("shard-*.parquet")):
            stored, entry = _entry(path)
            identity.check_append(stored, str(store.directory))
            store.entries[entry.block] = entry
        store.identity = identity
        return store

    def todo(self) -> list[int]:
        """The blocks with no shard yet, in order."""
        return [b for b in range(self.identity.blocks) if b not in self.entries]

    def add(self, block: int) -> ShardEntry:
        """Record block `block`'s shard (just written) and rewrite the manifest."""
        _, entry = _entry(self.directory / shard_name(block))
        self.entries[block] = entry
        self.write_manifest()
        return entry

    def manifest(self) -> dict:
        shards = [vars(self.entries[b]) for b in sorted(self.entries)]
        return {
            "identity": self.identity.to_json(),
            "blocks": self.identity.blocks,
            "complete": len(self.entries) == self.identity.blocks,
            "rows": sum(s["rows"] for s in shards),
            "positions": sum(s["positions"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "shards": shards,
        }

    def write_manifest(self) -> None:
        final = self.directory / MANIFEST
        tmp = final.with_name(f"{MANIFEST}.{os.getpid()}{TMP_SUFFIX}")
        tmp.write_text(json.dumps(self.manifest(), indent=1, sort_keys=True) + "\n")
        os.replace(tmp, final)

    def shard_paths(self) -> list[Path]:
        return [self.directory / self.entries[b].file for b in sorted(self.entries)]
