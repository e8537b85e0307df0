"""What a scoring job shows while it runs: a progress bar with rows/s and tokens/s in a terminal
(tqdm, when installed), and one line per shard written, always (a log file reads those).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from proctor.client.offline.store import DatasetStore, ShardEntry


class JobProgress:
    """`on_start` and `on_shard` for `run_job` / `run_ray_job`."""

    def __init__(self, out: TextIO = sys.stderr, *, bar: bool | None = None) -> None:
        self.out = out
        self.bar_wanted = out.isatty() if bar is None else bar
        self.bar = None
        self.started = time.perf_counter()
        self.rows = self.positions = 0

    def on_start(self, store: DatasetStore) -> None:
        identity = store.identity
        done = sum(e.rows for e in store.entries.values())
        self.out.write(f"score-dataset: {identity.input_rows} rows in {identity.blocks} blocks of "
                       f"{identity.block_rows}; {len(store.entries)} blocks ({done} rows) already stored\n")
        self.started = time.perf_counter()
        if self.bar_wanted:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=identity.input_rows, initial=done, unit="row", file=self.out)

    def on_shard(self, entry: ShardEntry, *_: object) -> None:
        self.rows += entry.rows
        self.positions += entry.positions
        seconds = max(time.perf_counter() - self.started, 1e-9)
        rates = f"{self.rows / seconds:.1f} rows/s, {self.positions / seconds:.0f} tokens/s"
        line = (f"{entry.file}: {entry.rows} rows, {entry.positions} positions, {entry.bytes} bytes "
                f"({entry.bytes / max(entry.positions, 1):.1f} B/position); {rates}")
        if self.bar is not None:
            self.bar.set_postfix_str(rates, refresh=False)
            self.bar.update(entry.rows)
            self.bar.write(line, file=self.out)
        else:
            self.out.write(line + "\n")
            self.out.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
