"""Where a server replica runs its engine: in a replica worker of its own (`WorkerClient`), so the
front process runs no engine's Python and each replica's processes get its own visible devices.
`inference.replica_worker: false` keeps a torch replica in the front process (one process to
debug; its forward pass then shares the front's interpreter with the transports).
"""

from __future__ import annotations

from proctor.server.engines.base import ENGINE_NAMES, SPAWNING_ENGINES, EngineSpec, TeacherEngine
from proctor.server.engines.factory import create_engine
from proctor.server.worker.client import WorkerClient


def create_replica_engine(spec: EngineSpec, *, name: str = "") -> TeacherEngine:
    """The engine one replica of this server runs: in a replica worker of its own."""
    in_front = (spec.inference or {}).get("replica_worker") is False and spec.name not in SPAWNING_ENGINES
    if spec.name not in ENGINE_NAMES or in_front:
        return create_engine(spec)  # an unknown name fails here, with the list of engines
    return WorkerClient(spec, name=name)
