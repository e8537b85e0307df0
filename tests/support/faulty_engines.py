"""Real torch engines with an injected device fault, built in a replica worker process.

`WorkerClient(build=...)` pickles the build function into the worker, so these must be
importable there (the test puts tests/ on the worker's PYTHONPATH). The scores are the real
engine's; only the fault is injected, as the device would raise it.
"""

from __future__ import annotations

import torch

from proctor.server.engines.base import EngineRequest, EngineSpec, Outcome
from proctor.server.engines.torch.engine import TorchEngine

# Batches larger than this run out of memory.
OOM_ABOVE_REQUESTS = 4


class OutOfMemoryAboveFour(TorchEngine):
    """The torch engine on a device too small for more than four requests at once: a larger
    batch raises torch's own `OutOfMemoryError` (what CUDA raises), before any row is computed."""

    def _score_sync(self, batch: list[EngineRequest], prepared=None) -> list[Outcome]:
        if len(batch) > OOM_ABOVE_REQUESTS:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB for a batch of {len(batch)} requests"
            )
        return super()._score_sync(batch, prepared)


def build_out_of_memory_above_four(spec: EngineSpec) -> TorchEngine:
    return OutOfMemoryAboveFour(spec)
