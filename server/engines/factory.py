"""Which engine a teacher's `inference.name` builds, and where a replica runs it.

Engines import lazily: vLLM and vLLM-Omni are optional extras and heavy to import.
`create_replica_engine` is what a server replica runs: every engine in a replica worker of its
own (`WorkerClient`), so the front process runs no engine's Python and each replica's
processes get its own visible devices. `inference.replica_worker: false` keeps a torch replica
in the front process (one process to debug; its forward pass then shares the front's
interpreter with the transports).
"""

from __future__ import annotations

from proctor.server.engines.base import (
    ENGINE_NAMES,
    SPAWNING_ENGINES,
    EngineConfigError,
    EngineSpec,
    TeacherEngine,
)
from proctor.server.engines.invariance import invariant_spec


def create_engine(spec: EngineSpec) -> TeacherEngine:
    """Build (not start) the engine that spec names (a batch-invariant teacher's as `invariant_spec`
    serves it: refused where it cannot be, prompt reuse off)."""
    spec = invariant_spec(spec)
    if spec.name == "torch":
        from proctor.server.engines.torch.engine import TorchEngine

        return TorchEngine(spec)
    if spec.name == "vllm":
        from proctor.server.engines.vllm.engine import VllmEngine

        return VllmEngine(spec)
    if spec.name == "vllm_omni":
        from proctor.server.engines.vllm_omni.engine import VllmOmniEngine

        return VllmOmniEngine(spec)
    raise EngineConfigError(
        f"unknown engine {spec.name!r} (inference.name): choose one of {', '.join(ENGINE_NAMES)}"
    )


def create_replica_engine(spec: EngineSpec, *, name: str = "") -> TeacherEngine:
    """The engine one replica of this server runs: in a replica worker of its own."""
    in_front = (spec.inference or {}).get("replica_worker") is False and spec.name not in SPAWNING_ENGINES
    if spec.name not in ENGINE_NAMES or in_front:
        return create_engine(spec)  # an unknown name fails here, with the list of engines
    from proctor.server.worker.client import WorkerClient

    return WorkerClient(spec, name=name)
