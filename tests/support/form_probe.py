"""The real torch engine that also says in what form it was handed a request's ids.

Built in a replica worker (`WorkerClient(build=...)`, so importable there: the test puts tests/
on the worker's PYTHONPATH). A request whose id is `PROBE` is refused with a description of its
`token_ids` and `score_ids` (type, dtype, C-contiguity, whether the array owns its memory) as the
reason, which reaches the caller as the INVALID_ARGUMENT message; every other request is scored
by the engine as usual.
"""

from __future__ import annotations

import numpy as np

from proctor.server.engines.base import EngineRequest, EngineSpec, Outcome, RequestRejected
from proctor.server.engines.torch.engine import TorchEngine

PROBE = "form-probe"


def describe(ids: np.ndarray | None) -> str:
    if ids is None:
        return "none"
    flags = ids.flags
    return (f"{type(ids).__module__}.{type(ids).__name__} {ids.dtype} shape={list(ids.shape)} "
            f"contiguous={flags.c_contiguous} owndata={flags.owndata}")


class FormReportingEngine(TorchEngine):
    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        probes = {r.key: RequestRejected("token_ids", f"{describe(r.token_ids)} | {describe(r.score_ids)}")
                  for r in batch if r.request_id == PROBE}
        scored = iter(await super().score([r for r in batch if r.key not in probes]))
        return [probes[r.key] if r.key in probes else next(scored) for r in batch]


def build_form_reporting(spec: EngineSpec) -> TorchEngine:
    return FormReportingEngine(spec)
