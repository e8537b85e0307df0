"""A stored dataset read back for training: per sequence, the tensors `TeacherClient` gives online.

`OfflineScores` (a torch map-style `Dataset`) and `OfflineStream` (an `IterableDataset`, shards
split over DataLoader workers) yield `StoredSequence`s: the input row's index, its token ids, and
a `TeacherScores` in proctor's row convention (rows first_row..T-1; float32 log-probs, int32
top-k ids, float32 top-k log-probs), so `proctor.client.loss`'s top-k and sampled losses take
them exactly as they take a live teacher's answers. `hf_dataset` opens the same shards with
Hugging Face `datasets`, decoding each row to the same tensors on access. `collate` packs a list
of sequences for the losses (`packed_scores`).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from proctor.client.offline.shards import StoredSequence, decode_row
from proctor.client.offline.store import DatasetStore


class OfflineScores(Dataset):
    """Map-style: item i is the dataset's i-th stored sequence, shards in block order."""

    def __init__(self, directory: Path | str, *, cached_shards: int = 2) -> None:
        self.store = DatasetStore.read(directory)
        self.identity = self.store.identity
        self.paths = self.store.shard_paths()
        self._starts = [0]
        for block in sorted(self.store.entries):
            self._starts.append(self._starts[-1] + self.store.entries[block].rows)
        self._shard = functools.lru_cache(maxsize=cached_shards)(self._read_shard)

    def _read_shard(self, position: int) -> list[dict]:
        return pq.read_table(self.paths[position]).to_pylist()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, item: int) -> StoredSequence:
        if item < 0:
            item += len(self)
        if not 0 <= item < len(self):
            raise IndexError(f"index {item} out of range for {len(self)} sequences")
        position = bisect.bisect_right(self._starts, item) - 1
        return decode_row(self._shard(position)[item - self._starts[position]], self.identity)


class OfflineStream(IterableDataset):
    """Iterable: every stored sequence once, shard by shard (each DataLoader worker its own shards)."""

    def __init__(self, directory: Path | str) -> None:
        self.store = DatasetStore.read(directory)
        self.identity = self.store.identity
        self.paths = self.store.shard_paths()

    def __iter__(self) -> Iterator[StoredSequence]:
        worker = get_worker_info()
        paths = self.paths if worker is None else self.paths[worker.id :: worker.num_workers]
        for path in paths:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
                for row in batch.to_pylist():
                    yield decode_row(row, self.identity)


def hf_dataset(directory: Path | str):
    """The shards as a Hugging Face `datasets.Dataset`, each row decoded on access to
    {"index", "token_ids", "first_row", "logprobs", "topk_ids", "topk_logprobs", ...} tensors."""
    import datasets

    store = DatasetStore.read(directory)
    identity = store.identity
    dataset = datasets.Dataset.from_parquet([str(p) for p in store.shard_paths()])

    def decode(batch: dict) -> dict:
        names = list(batch)
        out: dict[str, list] = {}
        for values in zip(*(batch[n] for n in names), strict=True):
            stored = decode_row(dict(zip(names, values, strict=True)), identity)
            for key, value in sequence_tensors(stored).items():
                out.setdefault(key, []).append(value)
        return out

    dataset.set_transform(decode)
    return dataset


def sequence_tensors(stored: StoredSequence) -> dict[str, torch.Tensor | int]:
    """One sequence as a flat dict of its tensors (what `hf_dataset` yields per row)."""
    scores = stored.scores
    out: dict[str, torch.Tensor | int] = {"index": stored.index, "token_ids": stored.token_ids,
                                          "first_row": scores.first_row}
    for name in ("logprobs", "topk_ids", "topk_logprobs", "score_logprobs", "hidden_states"):
        if getattr(scores, name) is not None:
            out[name] = getattr(scores, name)
    return out


def packed_scores(batch: Sequence[StoredSequence]) -> dict[str, torch.Tensor]:
    """The batch's response rows packed in order, as the losses take them: ``teacher_logprobs``
    [N], ``teacher_topk_ids`` int64 [N, K], ``teacher_topk_logprobs`` [N, K] (those stored)."""
    out = {}
    scores = [s.scores for s in batch]
    if scores and scores[0].logprobs is not None:
        out["teacher_logprobs"] = torch.cat([s.logprobs for s in scores])
    if scores and scores[0].topk_ids is not None:
        out["teacher_topk_ids"] = torch.cat([s.topk_ids for s in scores]).long()
        out["teacher_topk_logprobs"] = torch.cat([s.topk_logprobs for s in scores])
    return out
