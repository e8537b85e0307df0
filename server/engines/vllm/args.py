"""A teacher's settings → vLLM engine arguments and sampling parameters (no vLLM import).

verl's `inference.*` names become vLLM's EngineArgs names; `engine_kwargs.<engine>.*` passes
through; `dtype: auto` is the checkpoint's; on CPU a modest memory share unless told otherwise.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from proctor.server.engines.base import (
    EngineConfigError,
    EngineRequest,
    EngineSpec,
    serving_dtype,
)
from proctor.server.engines.checkpoint import model_facts
from proctor.server.engines.vllm.adapter import CPU_THREADS_BIND_ENV

log = logging.getLogger(__name__)


# verl `inference.*` name → vLLM EngineArgs name. Everything else in `inference` is verl's
# rollout config (temperature, load_format=dummy, free_cache_engine, ...) and means nothing to a
# frozen teacher; `engine_kwargs.<engine>.*` is passed through to vLLM as given.
SETTING_TO_ENGINE_ARG = {
    "tensor_model_parallel_size": "tensor_parallel_size",
    "data_parallel_size": "data_parallel_size",
    "pipeline_model_parallel_size": "pipeline_parallel_size",
    "expert_parallel_size": None,  # vLLM derives EP from TP x DP; kept out on purpose
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_model_len": "max_model_len",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "max_num_seqs": "max_num_seqs",
    "enforce_eager": "enforce_eager",
    "enable_prefix_caching": "enable_prefix_caching",
    "kv_cache_dtype": "kv_cache_dtype",
    "quantization": "quantization",
    "trust_remote_code": "trust_remote_code",
    "seed": "seed",
}

# proctor's own keys in `engine_kwargs.<engine>` (never passed to vLLM; the vLLM engine checks
# `score_ids_method` at start).
PROCTOR_ENGINE_KEYS = frozenset({"score_ids_method"})


def engine_kwargs_of(spec: EngineSpec, engine: str) -> dict[str, Any]:
    """`inference.engine_kwargs.<engine>` as a plain dict (empty when absent)."""
    kwargs = (spec.inference or {}).get("engine_kwargs") or {}
    own = kwargs.get(engine) or {}
    if not isinstance(own, Mapping):
        raise EngineConfigError(f"inference.engine_kwargs.{engine} must be a mapping, got {type(own).__name__}")
    return dict(own)


def resolve_max_logprobs(spec: EngineSpec, engine: str) -> int:
    """`engine_kwargs.<engine>.max_logprobs` (or `inference.max_logprobs`), seeded from the top-k."""
    kwargs = engine_kwargs_of(spec, engine)
    value = kwargs.get("max_logprobs", (spec.inference or {}).get("max_logprobs"))
    return int(value) if value is not None else int(spec.max_topk)


# On CPU, vLLM's `gpu_memory_utilization` is the share of the machine's memory it reserves for
# its KV cache, refused when that much is not free; vLLM's 0.92 default never fits a node that
# runs anything else (or a second replica), so a CPU teacher gets this unless told otherwise.
CPU_MEMORY_FRACTION = 0.1


def resolve_dtype(spec: EngineSpec) -> str:
    """`dtype: auto` is the checkpoint's own dtype on every engine.

    vLLM's own "auto" serves a float32 checkpoint in bfloat16/float16, which would make the
    vLLM and torch engines disagree by ~5e-2 on the same model; the torch engine keeps the
    checkpoint's dtype, so vLLM is told it explicitly.
    """
    if spec.dtype and spec.dtype != "auto":
        return spec.dtype
    try:
        return serving_dtype(spec.dtype, model_facts(spec.model_path).dtype)
    except (EngineConfigError, OSError, KeyError, ValueError):  # a nested config: vLLM reads it
        return "auto"


def engine_args_from_settings(
    spec: EngineSpec,
    *,
    engine: str = "vllm",
    max_logprobs: int,
    prefix_caching: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for vLLM's (Async)EngineArgs from a teacher's settings.

    The prefix cache is on only with `prefix_caching` (shared-prompt reuse, `vllm.prefix`: no other
    request reads it) unless the settings turn it off; `max_logprobs` (a sampling limit) is not
    vLLM's concern on the pooling runner, where the top-k is proctor's pooler's.
    """
    settings = spec.inference or {}
    args: dict[str, Any] = {"model": str(spec.model_path), "dtype": resolve_dtype(spec)}
    for key, arg in SETTING_TO_ENGINE_ARG.items():
        if arg is not None and settings.get(key) is not None:
            args[arg] = settings[key]
    if args.get("gpu_memory_utilization") is None and spec.device.startswith("cpu"):
        args["gpu_memory_utilization"] = CPU_MEMORY_FRACTION
    args["disable_log_stats"] = True
    passthrough = engine_kwargs_of(spec, engine)
    for key in (*PROCTOR_ENGINE_KEYS, "max_logprobs"):
        passthrough.pop(key, None)
    args.update(passthrough)
    args["enable_prefix_caching"] = bool(prefix_caching) and settings.get("enable_prefix_caching") is not False
    return args


def scoring_sampling_kwargs(topk: int) -> dict[str, Any]:
    """SamplingParams for a pure prefill that returns prompt log-probs (vLLM-Omni's AR stage).

    detokenize=False: decoding every candidate token string stalls the engine (verl PR 7648).
    """
    return {
        "max_tokens": 1,
        "prompt_logprobs": int(topk),
        "detokenize": False,
        "flat_logprobs": True,
        "temperature": 1.0,
        "skip_reading_prefix_cache": True,
    }


def engine_request_id(request: EngineRequest) -> str:
    """Unique per attempt: the service may retry one request id on the same engine."""
    return f"{request.request_id}-{uuid.uuid4().hex[:12]}"


def cpu_binding_environment(spec: EngineSpec, cores: list[int], environ: Mapping[str, str]) -> dict[str, str]:
    """The cores a vLLM replica on CPU binds its compute to: its own, as a GPU replica gets its own
    devices. The plan numbers a CPU replica's devices like GPUs (replica i: device i, one per rank);
    device d runs on the machine's core `cores[d mod len(cores)]`. Left to vLLM's "auto", two
    replicas bind the same core, and one that restarts starves the one serving. A bind the operator
    set in the server's environment is theirs (nothing added)."""
    if spec.name != "vllm" or spec.device.split(":", 1)[0] != "cpu" or not spec.devices or not cores:
        return {}
    if CPU_THREADS_BIND_ENV in environ:
        return {}
    ranks = [str(cores[int(device) % len(cores)]) for device in spec.devices if device.isdigit()]
    return {CPU_THREADS_BIND_ENV: "|".join(ranks)} if ranks else {}
