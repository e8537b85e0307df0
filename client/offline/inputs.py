"""The input of a scoring job: a dataset read by fixed blocks, each row made into a teacher request.

Sources: a local JSONL or Parquet file, a dataset directory saved by Hugging Face `datasets`
(`save_to_disk`), or a dataset name `datasets.load_dataset` resolves (with `split`). Rows give
token ids (``token_ids`` or ``input_ids``, optional ``prompt_length``), or text through the
teacher's tokenizer: ``prompt`` + ``response`` (the prompt's length is the first scored row),
``text`` (every row scored), or ``messages`` (the chat template; the last message is the scored
response). An optional column of ids to score per row (``score_ids``: R lists) is passed through.

Blocks are fixed by the row count and `block_rows` alone, so a restarted job cuts the same blocks;
the input's fingerprint (a digest of the file, or the dataset's own) is part of the identity, so a
changed input refuses to append.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class EncodedRow:
    """One input row as the teacher request's parts."""

    index: int
    token_ids: list[int]
    prompt_length: int | None
    score_ids: list[list[int]] | None = None


class InputError(ValueError):
    """A row or source the job cannot read; the message names the row and the column."""


def _file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()


class InputRows:
    """Random access to a dataset's rows by block (`block`), and its fingerprint."""

    def __init__(self, source: str, *, split: str = "train") -> None:
        self.source = source
        path = Path(source)
        self._lines: list[int] | None = None
        self._table = None
        if path.is_file() and path.suffix in (".jsonl", ".json"):
            self._path, self.fingerprint = path, _file_digest(path)
            self._lines = self._line_offsets(path)
            self.num_rows = len(self._lines)
        elif path.is_file() and path.suffix == ".parquet":
            import pyarrow.parquet as pq

            self._table, self.fingerprint = pq.read_table(path, memory_map=True), _file_digest(path)
            self.num_rows = self._table.num_rows
        else:
            self._table = self._hf_dataset(source, split)
            self.fingerprint = f"datasets:{self._table._fingerprint}"
            self.num_rows = len(self._table)

    @staticmethod
    def _hf_dataset(source: str, split: str):
        import datasets

        if Path(source).is_dir() and (Path(source) / "dataset_info.json").exists():
            return datasets.load_from_disk(source)
        return datasets.load_dataset(source, split=split)

    @staticmethod
    def _line_offsets(path: Path) -> list[int]:
        offsets, position = [], 0
        with open(path, "rb") as handle:
            for line in handle:
                if line.strip():
                    offsets.append(position)
                position += len(line)
        return offsets

    def rows(self, start: int, stop: int) -> list[dict[str, Any]]:
        """Rows start..stop-1 as dicts."""
        stop = min(stop, self.num_rows)
        if self._lines is not None:
            out = []
            with open(self._path, "rb") as handle:
                for position in self._lines[start:stop]:
                    handle.seek(position)
                    out.append(json.loads(handle.readline()))
            return out
        if hasattr(self._table, "slice"):  # a pyarrow table
            return self._table.slice(start, stop - start).to_pylist()
        return list(self._table.select(range(start, stop)))

    def block(self, block: int, block_rows: int) -> list[dict[str, Any]]:
        return self.rows(block * block_rows, (block + 1) * block_rows)


class RowEncoder:
    """Input rows → `EncodedRow`s (token ids as given, or text through the teacher's tokenizer)."""

    def __init__(self, tokenizer_dir: str | Path | None = None, score_ids_column: str = "") -> None:
        self._tokenizer_dir = tokenizer_dir
        self._tokenizer = None
        self.score_ids_column = score_ids_column
        if tokenizer_dir is not None:  # here, once: blocks are encoded in worker threads, and an import
            self.tokenizer  # noqa: B018  (transformers' lazy one) racing in two threads fails

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self._tokenizer_dir is None:
                raise InputError("rows hold text: give the teacher's tokenizer (--tokenizer DIR)")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self._tokenizer_dir), local_files_only=True)
        return self._tokenizer

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _from_text(self, row: dict) -> tuple[list[int], int | None]:
        if "messages" in row:
            messages = list(row["messages"])
            prompt = self.tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
            full = self.tokenizer.apply_chat_template(messages, tokenize=False)
            if not full.startswith(prompt):
                raise InputError("messages: the chat template does not render the conversation's start as its prompt")
            prompt_ids = self._ids(prompt)
            return prompt_ids + self._ids(full[len(prompt):]), len(prompt_ids)
        if "prompt" in row and "response" in row:
            prompt_ids = self._ids(row["prompt"])
            return prompt_ids + self._ids(row["response"]), len(prompt_ids)
        return self._ids(row["text"]), None

    def encode(self, index: int, row: dict) -> EncodedRow:
        ids_column = next((c for c in ("token_ids", "input_ids") if row.get(c) is not None), None)
        if ids_column is not None:
            ids, prompt_length = [int(t) for t in row[ids_column]], row.get("prompt_length")
        elif any(c in row for c in ("messages", "text", "prompt")):
            ids, prompt_length = self._from_text(row)
        else:
            raise InputError(f"row {index}: no token_ids, input_ids, text, prompt+response or messages column "
                             f"(columns: {', '.join(sorted(row))})")
        score_ids = None
        if self.score_ids_column:
            if row.get(self.score_ids_column) is None:
                raise InputError(f"row {index}: column {self.score_ids_column!r} is missing")
            score_ids = [[int(t) for t in r] for r in row[self.score_ids_column]]
        return EncodedRow(index, ids, None if prompt_length is None else int(prompt_length), score_ids)

    def encode_block(self, start: int, rows: Sequence[dict]) -> list[EncodedRow]:
        return [self.encode(start + offset, row) for offset, row in enumerate(rows)]
