"""What `inference.batch_invariant` means for a teacher: the one place that decides where a
teacher can be batch-invariant, what that turns off, and what its engine's processes need.

A batch-invariant teacher scores a sequence the same, bit for bit, whatever requests share its
batch, wherever it sits in the batch, however the batch is padded, and whichever replica of the
teacher (on the same device type) answers. Per engine:

- torch: one unpadded forward per sequence and a head pass over that sequence's rows alone
  (`engines/torch/invariant.py`), on every device;
- vLLM: vLLM's own batch-invariant mode (`VLLM_BATCH_INVARIANT=1` in the replica's environment,
  never the front's `os.environ`) where vLLM implements it (`adapter.BATCH_INVARIANT_DEVICES`);
  elsewhere the replica is refused at start, naming the platform;
- vLLM-Omni: refused (its AR stage was never checked under vLLM's mode).

Shared-prompt reuse scores a group's later members against a cached prefix, in passes whose shapes
depend on the group: not invariant, so a batch-invariant teacher serves with it off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from proctor.server.engines.base import EngineConfigError, EngineSpec
from proctor.server.engines.vllm.adapter import BATCH_INVARIANT_DEVICES, BATCH_INVARIANT_ENV, SUPPORTED_VLLM

log = logging.getLogger(__name__)

KEY = "batch_invariant"


def batch_invariant(inference: Mapping[str, Any] | None) -> bool:
    """Whether a teacher's `inference` settings ask for batch-invariant scores."""
    return bool((inference or {}).get(KEY))


def check_batch_invariant(engine: str, device: str) -> None:
    """Refuse a batch-invariant teacher where its engine cannot be batch-invariant."""
    kind = device.split(":", 1)[0]
    if engine == "vllm_omni":
        raise EngineConfigError(
            f"inference.{KEY}: the vllm_omni engine does not serve batch-invariant scores; serve the teacher "
            f"with inference.name=torch or vllm, or remove {KEY}")
    if engine == "vllm" and kind not in BATCH_INVARIANT_DEVICES:
        raise EngineConfigError(
            f"inference.{KEY}: vLLM {'/'.join(SUPPORTED_VLLM)}'s batch-invariant mode ({BATCH_INVARIANT_ENV}) runs on "
            f"{', '.join(BATCH_INVARIANT_DEVICES)} devices, and this replica runs on {kind} (the platform has "
            "no batch-invariant kernels in vLLM); serve the teacher with inference.name=torch, which is "
            f"batch-invariant on every device, or remove {KEY}")


def invariant_spec(spec: EngineSpec) -> EngineSpec:
    """`spec` as it is served: a batch-invariant teacher's checked for its engine and device, with
    shared-prompt reuse off (whatever `prompt_reuse` says). Other specs are returned as they are."""
    if not batch_invariant(spec.inference):
        return spec
    check_batch_invariant(spec.name, spec.device)
    if spec.inference.get("prompt_reuse") is False:
        return spec
    log.info("batch-invariant teacher (%s engine): shared-prompt reuse is off", spec.name)
    return replace(spec, inference={**spec.inference, "prompt_reuse": False})


def invariance_environment(spec: EngineSpec) -> dict[str, str]:
    """Variables a replica's engine processes start with for batch invariance (vLLM's switch)."""
    if spec.name == "vllm" and batch_invariant(spec.inference):
        return {BATCH_INVARIANT_ENV: "1"}
    return {}
