"""Which engine a teacher's `inference.name` builds.

Engines import lazily: vLLM and vLLM-Omni are optional extras and heavy to import. Where a
replica runs the engine (a worker process of its own) is the worker package's choice
(`proctor.server.worker.replica_engine`).
"""

from __future__ import annotations

from proctor.server.engines.base import (
    ENGINE_NAMES,
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
