"""vLLM-Omni's configuration for a teacher: the pipeline adapters proctor knows, the Thinker
stage's engine args, and the stage/deploy config file in the schema of the installed version
(0.30.0 reads a deploy config naming a thinker-only pipeline, 0.18.0 a `stage_args` file).
See `engine` (and `startup`) for what each setting does and which upstream code it mirrors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proctor.server.engines.base import (
    EngineConfigError,
    EngineSpec,
)
from proctor.server.engines.vllm.args import (
    SETTING_TO_ENGINE_ARG,
    engine_kwargs_of,
)

log = logging.getLogger(__name__)


ENGINE = "vllm_omni"
# engine_kwargs.vllm_omni keys that configure proctor / the pipeline, not the stage's engine.
OMNI_OWN_KEYS = frozenset(
    {"output_mode", "pipeline_name", "pipeline_mode", "stage_configs_path", "deploy_config", "max_logprobs"}
)
# Sequences the Thinker stage schedules at once when the teacher does not say (vLLM's own
# default for a GPU; vLLM-Omni's legacy default of 1 would score one sequence at a time).
DEFAULT_MAX_NUM_SEQS = 256
# Engine args that the 0.30.0 pipeline topology owns (`StagePipelineConfig`: the thinker-only
# topologies set engine_output_type "latent"), and one (disable_log_stats) that AsyncOmni takes as
# its `log_stats` argument: 0.30.0 refuses them in a deploy stage ("explicit engine argument(s)
# with no structured config owner", `config/omni_config.py:_validate_stage_engine_override_ownership`).
TOPOLOGY_ARGS = ("model_stage", "model_arch", "hf_config_name", "worker_cls", "scheduler_cls",
                 "engine_output_type", "disable_log_stats")
# Pipeline-wide engine settings: 0.30.0 reads them at the deploy file's top level only
# (`config/stage_config.py:DeployConfig`; in a stage, distributed_executor_backend is ignored).
PIPELINE_WIDE_ARGS = ("trust_remote_code", "distributed_executor_backend", "dtype", "quantization",
                      "enable_prefix_caching", "enable_chunked_prefill", "data_parallel_size",
                      "pipeline_parallel_size")
@dataclass(frozen=True)
class OmniPipeline:
    """What proctor must know of one vLLM-Omni model family to serve its Thinker."""

    name: str
    model_arch: str
    hf_config_name: str  # the Thinker's sub-config in config.json
    head_names: tuple[str, ...]
    embed_names: tuple[str, ...]
    thinker_only: str  # the thinker-only topology vLLM-Omni 0.30.0 registers for this family


PIPELINES = {
    p.name: p
    for p in (
        OmniPipeline(
            "qwen3_omni_moe",
            "Qwen3OmniMoeForConditionalGeneration",
            "thinker_config",
            ("thinker.lm_head.weight",),
            ("thinker.model.embed_tokens.weight",),
            "qwen3_omni_moe_thinker_only",
        ),
        OmniPipeline(
            "qwen2_5_omni",
            "Qwen2_5OmniForConditionalGeneration",
            "thinker_config",
            ("thinker.lm_head.weight",),
            ("thinker.model.embed_tokens.weight",),
            "qwen2_5_omni_thinker_only",
        ),
    )
}


def omni_pipeline(spec: EngineSpec) -> OmniPipeline:
    """Validate `engine_kwargs.vllm_omni` (output_mode, pipeline_name) and return the adapter."""
    kwargs = engine_kwargs_of(spec, ENGINE)
    name = kwargs.get("pipeline_name")
    if name not in PIPELINES:
        raise EngineConfigError(
            f"inference.engine_kwargs.vllm_omni.pipeline_name is {name!r}: proctor knows "
            f"{', '.join(sorted(PIPELINES))}; set one of them (the model family of model_path). vLLM-Omni serves "
            "an Omni model's Thinker only: a vision-language teacher (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) runs on "
            "inference.name vllm or torch"
        )
    mode = kwargs.get("output_mode")
    if mode != "ar":
        raise EngineConfigError(
            f"inference.engine_kwargs.vllm_omni.output_mode is {mode!r}: a teacher runs the Thinker's AR "
            'pipeline only; set output_mode="ar"'
        )
    return PIPELINES[name]


def stage_engine_args(spec: EngineSpec, pipeline: OmniPipeline, max_logprobs: int) -> dict[str, Any]:
    """The Thinker stage's engine args: teacher settings, then engine_kwargs.vllm_omni pass-through."""
    settings = spec.inference or {}
    args: dict[str, Any] = {
        "model_stage": "thinker",
        "model_arch": pipeline.model_arch,
        "hf_config_name": pipeline.hf_config_name,
        "engine_output_type": "latent",  # makes the AR runner return hidden states
        "trust_remote_code": True,
        "dtype": spec.dtype or "auto",
        "max_logprobs": int(max_logprobs),
        "disable_log_stats": True,
    }
    kind = spec.device.split(":", 1)[0]
    if kind == "npu":
        args["worker_cls"] = "vllm_omni.worker.npu.npu_ar_worker.NPUARWorker"
    else:
        args["worker_cls"] = "vllm_omni.worker.gpu_ar_worker.GPUARWorker"
    args["scheduler_cls"] = "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler"
    for key, arg in SETTING_TO_ENGINE_ARG.items():
        if arg is not None and settings.get(key) is not None:
            args[arg] = settings[key]
    for key, value in engine_kwargs_of(spec, ENGINE).items():
        if key not in OMNI_OWN_KEYS:
            args[key] = value
    # Always explicit: where vLLM-Omni derives it from runtime.max_batch_size it defaults to 1.
    args["max_num_seqs"] = int(args.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
    if int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1)) > 1:
        args.setdefault("distributed_executor_backend", "mp")
    return args


def _stage_devices(args: Mapping[str, Any]) -> str:
    """The stage's device indices: the replica's devices are made visible by *_VISIBLE_DEVICES."""
    world = int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))
    world *= int(args.get("data_parallel_size", 1))
    return ",".join(str(i) for i in range(world))


SCORING_STAGE_DEFAULTS = {"max_tokens": 1, "detokenize": False}


def stage_config(spec: EngineSpec, pipeline: OmniPipeline, max_logprobs: int) -> dict[str, Any]:
    """A one-stage legacy `stage_args` config for the Thinker (what vLLM-Omni 0.18.0 reads).

    No `runtime.max_batch_size`: it is the legacy batch-size knob that vLLM-Omni turns into
    `max_num_seqs` (default 1); `engine_args.max_num_seqs` is set instead.
    """
    args = stage_engine_args(spec, pipeline, max_logprobs)
    return {
        "stage_args": [
            {
                "stage_id": 0,
                "stage_type": "llm",
                "runtime": {"devices": _stage_devices(args)},
                "engine_args": args,
                "final_output": True,
                "final_output_type": "text",
                "is_comprehension": True,
                "default_sampling_params": dict(SCORING_STAGE_DEFAULTS),
            }
        ]
    }


def deploy_config(spec: EngineSpec, pipeline: OmniPipeline, max_logprobs: int) -> dict[str, Any]:
    """A deploy config (vLLM-Omni 0.30.0's `deploy_config` schema) for the thinker-only pipeline.

    The topology (architecture, sub-config, worker, scheduler, engine output type) comes from the
    registered `<family>_thinker_only` pipeline; the pipeline-wide settings go at the top level
    and stage 0 carries the rest as flat keys, which vLLM-Omni sorts into `StageDeployConfig`
    fields and `engine_extras` (each must have an owner among its structured configs).
    """
    args = stage_engine_args(spec, pipeline, max_logprobs)
    for key in TOPOLOGY_ARGS:
        args.pop(key, None)
    wide = {key: args.pop(key) for key in PIPELINE_WIDE_ARGS if key in args}
    stage = {"stage_id": 0, "devices": _stage_devices({**args, **wide}), **args}
    stage["default_sampling_params"] = dict(SCORING_STAGE_DEFAULTS)
    return {"pipeline": pipeline.thinker_only, "async_chunk": False, **wide, "stages": [stage]}


def config_schema() -> str:
    """"deploy" where the installed vLLM-Omni reads deploy configs (0.30.0), else "stage_args"."""
    try:
        from vllm_omni.config.stage_config import load_deploy_config  # noqa: F401
    except ImportError:
        return "stage_args"
    return "deploy"
