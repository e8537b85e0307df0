"""What runs in a replica's Ray actor: `EngineActor`, one engine in the actor process on the
Ray worker, answering the front's remote calls (`ray_engine.RayEngine`).

The actor is a replica worker like a local one (`worker.main`): it answers results in wire form
(`wire.EncodedResult`, a few `bytes` objects through Ray's object store), so the front only
splices them into answers. Kept to the actor's side alone, so that the actor process imports
nothing of the front's (the client, the placement groups).
"""

from __future__ import annotations

import torch

from proctor.server.engines.base import EngineInfo, EngineRequest, EngineSpec, Outcome
from proctor.server.worker.pool import VISIBLE_DEVICES_ENV
from proctor.server.worker.wire import encode_outcomes


class EngineActor:
    """Runs one engine inside a Ray actor (async: Ray gives it an event loop)."""

    def __init__(self, spec: EngineSpec) -> None:
        import os

        from proctor.server.engines.factory import create_engine

        if spec.placement_group is not None:
            # The actor of a spanning replica holds no device, and Ray hides every device from
            # such an actor; its engine's workers get theirs from their own bundles.
            for name in VISIBLE_DEVICES_ENV.values():
                if os.environ.get(name) == "":
                    os.environ.pop(name)
        from proctor.server.common.malloc_tuning import keep_large_buffers

        self.spec = spec
        keep_large_buffers()  # the actor is a replica worker: results' buffers reused, not re-faulted
        self.engine = create_engine(spec)

    async def start(self) -> tuple[EngineInfo, int]:
        await self.engine.start()
        return self.engine.describe(), self.engine.token_budget()

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        return encode_outcomes(await self.engine.score(batch))

    async def abort(self, request_keys: list[str]) -> None:
        await self.engine.abort(request_keys)

    def unembedding(self) -> torch.Tensor:
        return self.engine.unembedding()

    async def check_health(self) -> bool:
        return await self.engine.check_health()

    async def close(self) -> None:
        await self.engine.close()

