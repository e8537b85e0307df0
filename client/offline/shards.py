"""One shard: a block of scored sequences as a Parquet table (zstd), one row per sequence.

Columns (a sequence of T tokens, rows first_row..T-1, R = T - first_row; proctor's row
convention, as `TeacherScores` holds it):

- ``index`` int64: the sequence's row in the input; ``token_ids`` list<int32>; ``first_row`` int32;
- ``logprobs`` list<float32> [R]: the sampled token's log-prob;
- ``topk_ids`` binary: [R, K] ids bit-packed in the identity's ``id_bits``;
- ``topk_logprobs`` binary: [R, K] in the identity's ``topk_form`` (``codecs``), with
  ``topk_offset`` / ``topk_scale`` list<float32> [R] for the ``u8`` form;
- ``score_logprobs`` binary float32 [R, S] (with ``score_width`` S): log-probs at the input's ids;
- ``hidden_states`` binary [R, ``hidden_width``] in ``hidden_dtype`` (the wire form asked).

A shard is written to a temporary name beside its final one, flushed and renamed: a shard file
that exists is whole, which is what makes a killed job's restart exactly-once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from proctor.client.offline import codecs
from proctor.client.offline.identity import DatasetIdentity
from proctor.client.scores import TeacherScores

COMPRESSION = "zstd"
COMPRESSION_LEVEL = 3
TMP_SUFFIX = ".tmp"


@dataclass
class StoredSequence:
    """One stored sequence: its input row, its ids, and the teacher's scores as online."""

    index: int
    token_ids: torch.Tensor  # int64 [T]
    scores: TeacherScores
    topk_error: torch.Tensor | None = None  # float32 [R, K]: the stated largest error of each stored value

    @property
    def prompt_length(self) -> int:
        return self.scores.first_row


def shard_name(block: int) -> str:
    return f"shard-{block:06d}.parquet"


def _hidden_bytes(hidden: torch.Tensor) -> tuple[bytes, int, str]:
    dtype = str(hidden.dtype).removeprefix("torch.")
    return hidden.contiguous().view(torch.uint8).numpy().tobytes(), hidden.shape[1], dtype


def _offsets(counts: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int32)


def _lists(values: np.ndarray, counts: Sequence[int], item: pa.DataType) -> pa.Array:
    """One list per sequence over `values` cut by `counts` (built in one pass, no Python loop)."""
    return pa.ListArray.from_arrays(pa.array(_offsets(counts)), pa.array(values, type=item))


def _binaries(data: bytes, counts: Sequence[int]) -> pa.Array:
    """One binary value per sequence over `data` cut into `counts` bytes."""
    offsets = _offsets(counts)
    return pa.Array.from_buffers(pa.binary(), len(counts), [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)])


def _packed_ids(ids: list[np.ndarray], rows: list[int], bits: int) -> pa.Array:
    k = ids[0].shape[1] if ids else 0
    if (k * bits) % 8 == 0:  # each row whole bytes: the block packs at once, cut at row boundaries
        return _binaries(codecs.pack_ids(np.concatenate(ids), bits), [r * k * bits // 8 for r in rows])
    return pa.array([codecs.pack_ids(one, bits) for one in ids], type=pa.binary())


def _topk_columns(columns: dict, scores: Sequence[TeacherScores], rows: list[int], identity: DatasetIdentity) -> None:
    ids = [s.topk_ids.numpy() for s in scores]
    columns["topk_ids"] = _packed_ids(ids, rows, identity.id_bits)
    values = np.concatenate([s.topk_logprobs.numpy() for s in scores])
    data, offset, scale = codecs.encode_topk_logprobs(values, identity.topk_form)
    width = values.itemsize if identity.topk_form == "f32" else {"f16": 2, "u8": 1}[identity.topk_form]
    columns["topk_logprobs"] = _binaries(data, [r * identity.topk * width for r in rows])
    if identity.topk_form == "u8":
        columns["topk_offset"] = _lists(offset, rows, pa.float32())
        columns["topk_scale"] = _lists(scale, rows, pa.float32())


def shard_table(indices: Sequence[int], token_ids: Sequence[Sequence[int]], scores: Sequence[TeacherScores],
                identity: DatasetIdentity) -> pa.Table:
    """The block's sequences and their scores as one table (schema in the module's docstring)."""
    rows = [s.num_rows for s in scores]
    lengths = [len(t) for t in token_ids]
    flat_ids = np.fromiter((int(t) for one in token_ids for t in one), dtype=np.int32, count=sum(lengths))
    columns: dict[str, pa.Array] = {
        "index": pa.array(list(indices), type=pa.int64()),
        "token_ids": _lists(flat_ids, lengths, pa.int32()),
        "first_row": pa.array([s.first_row for s in scores], type=pa.int32()),
    }
    if identity.logprobs:
        columns["logprobs"] = _lists(np.concatenate([s.logprobs.numpy() for s in scores]), rows, pa.float32())
    if identity.topk:
        _topk_columns(columns, scores, rows, identity)
    if identity.score_ids_column:
        columns["score_logprobs"] = pa.array([s.score_logprobs.float().numpy().tobytes() for s in scores],
                                             type=pa.binary())
        columns["score_width"] = pa.array([s.score_logprobs.shape[1] for s in scores], type=pa.int32())
    if identity.hidden_states:
        parts = [_hidden_bytes(s.hidden_states) for s in scores]
        columns["hidden_states"] = pa.array([p[0] for p in parts], type=pa.binary())
        columns["hidden_width"] = pa.array([p[1] for p in parts], type=pa.int32())
        columns["hidden_dtype"] = pa.array([p[2] for p in parts], type=pa.string())
    return pa.table(columns)


def write_shard(directory: Path, block: int, table: pa.Table, identity: DatasetIdentity) -> Path:
    """Write `table` as block `block`'s shard, atomically (temporary file, fsync, rename)."""
    final = directory / shard_name(block)
    tmp = final.with_name(f"{final.name}.{os.getpid()}{TMP_SUFFIX}")
    positions = int(pc.sum(pc.list_value_length(table["token_ids"])).as_py() or 0) - int(
        pc.sum(table["first_row"]).as_py() or 0)
    table = table.replace_schema_metadata(identity.metadata(block=block, rows=table.num_rows, positions=positions))
    pq.write_table(table, tmp, compression=COMPRESSION, compression_level=COMPRESSION_LEVEL,
                   use_dictionary=["token_ids"], write_statistics=False)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    return final


def _tensor(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(np.asarray(values), dtype=dtype)


def _decode_topk(row: dict, rows: int, identity: DatasetIdentity) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = identity.topk
    ids = codecs.unpack_ids(row["topk_ids"], rows * k, identity.id_bits).reshape(rows, k)
    offset = np.asarray(row.get("topk_offset") or [], np.float32)
    scale = np.asarray(row.get("topk_scale") or [], np.float32)
    values = codecs.decode_topk_logprobs(row["topk_logprobs"], (rows, k), identity.topk_form, offset, scale)
    error = codecs.row_error(values, identity.topk_form, scale)
    return torch.from_numpy(ids.copy()), torch.from_numpy(values.copy()), torch.from_numpy(np.array(error))


def decode_row(row: dict, identity: DatasetIdentity) -> StoredSequence:
    """A shard row (a dict of its columns, as pyarrow's `to_pylist` gives) → `StoredSequence`."""
    token_ids = torch.tensor(row["token_ids"], dtype=torch.int64)
    first_row = int(row["first_row"])
    rows = len(token_ids) - first_row
    scores = TeacherScores(request_id=f"offline-{row['index']}", teacher=identity.teacher, model=identity.model,
                           num_tokens=len(token_ids), first_row=first_row)
    stored = StoredSequence(index=int(row["index"]), token_ids=token_ids, scores=scores)
    if identity.logprobs:
        scores.logprobs = _tensor(row["logprobs"])
    if identity.topk:
        scores.topk_ids, scores.topk_logprobs, stored.topk_error = _decode_topk(row, rows, identity)
    if identity.score_ids_column:
        values = np.frombuffer(row["score_logprobs"], dtype="<f4").reshape(rows, int(row["score_width"]))
        scores.score_logprobs = torch.from_numpy(values.copy())
    if identity.hidden_states:
        dtype = getattr(torch, row["hidden_dtype"])
        flat = torch.frombuffer(bytearray(row["hidden_states"]), dtype=torch.uint8)
        scores.hidden_states = flat.view(dtype).reshape(rows, int(row["hidden_width"]))
    return stored
