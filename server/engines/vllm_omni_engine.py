"""A multimodal teacher replica on vLLM-Omni's AR pipeline (`AsyncOmni`): log-probs, top-k and
the Thinker's hidden states for prompts with images, audio and video.

Settings (`inference.engine_kwargs.vllm_omni`, as verl-omni writes them):
- `output_mode: "ar"` (required): the teacher runs the autoregressive Thinker only; no Talker,
  no Code2Wav (a teacher scores text tokens).
- `pipeline_name` (e.g. `qwen3_omni_moe`, `qwen2_5_omni`): selects the pipeline adapter, i.e.
  which architecture, HF sub-config and checkpoint names the Thinker has. Proctor writes a
  one-stage vLLM-Omni stage config for it (`stage_configs_path` overrides that file).
- `max_logprobs`: seeded from the teacher's top-k, validated against it.
- anything else is passed through to the Thinker stage's engine args.

Scoring is the vLLM engine's: one prompt per sequence, `SamplingParams(max_tokens=1,
prompt_logprobs=K, detokenize=False)`, with `multi_modal_data` decoded from the wire
(`server/media.py`) and `mm_processor_kwargs` exactly as the rollout sent them; the token ids
must already hold the expanded placeholders (what the rollout's processor produced and vLLM
generated from), and a result whose length differs is refused rather than misaligned.

Hidden states: vLLM-Omni's AR model runner (`GPUARModelRunner` / `NPUARModelRunner`) attaches
to every scheduled chunk a payload `{"hidden": <last-layer activations of the chunk's tokens>}`
when the stage's `engine_output_type` is not "text" (it is "latent" here); the output processor
accumulates the chunks (renaming "hidden" to the stage's output type) into the request output's
`multimodal_output`. Those are the Thinker's text hidden states after its final norm, what its
`lm_head` consumes, so one engine serves log-probs and hidden states together; they are read
only for requests that ask for them. The cost is the runner's device→host copy of [T, H] per
request, paid whether or not the request wanted hidden states.

vLLM-Omni needs CUDA or Ascend (no CPU platform) and pins its own transformers, so this engine
cannot run in CPU CI: the tests cover its settings, stage config, request construction and
payload extraction with fakes shaped like vLLM-Omni's classes, and everything it shares with
the vLLM engine (vllm_common.py) runs for real there. `bench/gpu_check.sh` runs it on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proctor.server.engines import EngineConfigError
from proctor.server.engines.base import EngineError, EngineRequest, EngineResult, EngineSpec
from proctor.server.engines.checks import check_vllm_settings
from proctor.server.engines.vllm_common import (
    SETTING_TO_ENGINE_ARG,
    VllmFamilyEngine,
    engine_kwargs_of,
    engine_request_id,
    extract_rows,
    hidden_rows,
    scoring_sampling_kwargs,
)

log = logging.getLogger(__name__)

ENGINE = "vllm_omni"
# engine_kwargs.vllm_omni keys that configure proctor / the pipeline, not the stage's engine.
OMNI_OWN_KEYS = frozenset({"output_mode", "pipeline_name", "pipeline_mode", "stage_configs_path", "max_logprobs"})
# Keys of the accumulated multimodal_output that hold the Thinker's hidden states, in order.
HIDDEN_KEYS = ("hidden", "latent", "latents", "model_outputs")


@dataclass(frozen=True)
class OmniPipeline:
    """What proctor must know of one vLLM-Omni model family to serve its Thinker."""

    name: str
    model_arch: str
    hf_config_name: str  # the Thinker's sub-config in config.json
    head_names: tuple[str, ...]
    embed_names: tuple[str, ...]


PIPELINES = {
    p.name: p
    for p in (
        OmniPipeline(
            "qwen3_omni_moe",
            "Qwen3OmniMoeForConditionalGeneration",
            "thinker_config",
            ("thinker.lm_head.weight",),
            ("thinker.model.embed_tokens.weight",),
        ),
        OmniPipeline(
            "qwen2_5_omni",
            "Qwen2_5OmniForConditionalGeneration",
            "thinker_config",
            ("thinker.lm_head.weight",),
            ("thinker.model.embed_tokens.weight",),
        ),
    )
}


def omni_pipeline(spec: EngineSpec) -> OmniPipeline:
    """Validate `engine_kwargs.vllm_omni` (output_mode, pipeline_name) and return the adapter."""
    kwargs = engine_kwargs_of(spec, ENGINE)
    mode = kwargs.get("output_mode")
    if mode != "ar":
        raise EngineConfigError(
            f"inference.engine_kwargs.vllm_omni.output_mode is {mode!r}: a teacher runs the Thinker's AR "
            'pipeline only; set output_mode="ar"'
        )
    name = kwargs.get("pipeline_name")
    if name not in PIPELINES:
        raise EngineConfigError(
            f"inference.engine_kwargs.vllm_omni.pipeline_name is {name!r}: proctor knows "
            f"{', '.join(sorted(PIPELINES))}; set one of them (the model family of model_path)"
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
    if int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1)) > 1:
        args.setdefault("distributed_executor_backend", "mp")
    return args


def stage_config(spec: EngineSpec, pipeline: OmniPipeline, max_logprobs: int) -> dict[str, Any]:
    """A one-stage vLLM-Omni stage config (the YAML's `stage_args`) for the Thinker."""
    args = stage_engine_args(spec, pipeline, max_logprobs)
    world = int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))
    world *= int(args.get("data_parallel_size", 1))
    return {
        "stage_args": [
            {
                "stage_id": 0,
                "stage_type": "llm",
                # The replica's devices are made visible by *_VISIBLE_DEVICES: index them locally.
                "runtime": {"devices": ",".join(str(i) for i in range(world)), "max_batch_size": 1},
                "engine_args": args,
                "final_output": True,
                "final_output_type": "text",
                "is_comprehension": True,
                "default_sampling_params": {"max_tokens": 1, "detokenize": False},
            }
        ]
    }


def build_prompt(request: EngineRequest) -> dict[str, Any]:
    """The TokensPrompt (a dict) for one request: ids, decoded media, processor kwargs as sent."""
    from proctor.server.media import multi_modal_data

    prompt: dict[str, Any] = {"prompt_token_ids": request.token_ids.tolist()}
    if request.media:
        prompt["multi_modal_data"] = multi_modal_data(request.media)
        if request.media.processor_kwargs:
            prompt["mm_processor_kwargs"] = dict(request.media.processor_kwargs)
    return prompt


def stage_output(output: Any) -> Any:
    """The vLLM RequestOutput inside an OmniRequestOutput (or the output itself)."""
    inner = getattr(output, "request_output", None)
    return inner if inner is not None else output


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return torch.cat([v.reshape(-1, v.shape[-1]) for v in value], dim=0)
    return None


def extract_hidden(request_output: Any, total: int) -> torch.Tensor:
    """The Thinker's per-position hidden states [T, H] from a finished request's multimodal output.

    vLLM-Omni attaches the accumulated payload to the RequestOutput (`multimodal_output`) and to
    its completion (`outputs[0].multimodal_output`); a chunked prefill leaves a list of chunks.
    """
    holders = [request_output, *list(getattr(request_output, "outputs", None) or [])[:1]]
    for holder in holders:
        payload = getattr(holder, "multimodal_output", None)
        if not isinstance(payload, Mapping):
            continue
        for key in HIDDEN_KEYS:
            states = _as_tensor(payload.get(key))
            if states is not None:
                if states.dim() != 2 or states.shape[0] < total:
                    raise EngineError(
                        f"vLLM-Omni returned hidden states of shape {tuple(states.shape)} for {total} tokens"
                    )
                return states[:total]  # a decode step, if any ran, is not part of the prompt
    raise EngineError(
        "vLLM-Omni returned no hidden states: the Thinker stage needs engine_output_type='latent' "
        f"(looked for {', '.join(HIDDEN_KEYS)} in multimodal_output)"
    )


class VllmOmniEngine(VllmFamilyEngine):
    """One multimodal teacher replica: vLLM-Omni's AsyncOmni running the Thinker stage."""

    engine_name = ENGINE
    media_kinds = ("images", "videos", "audios")

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.pipeline = omni_pipeline(spec)
        self.sub_config = (self.pipeline.hf_config_name,)
        self.head_names = self.pipeline.head_names
        self.embed_names = self.pipeline.embed_names
        self._omni = None
        self._stage_dir: tempfile.TemporaryDirectory | None = None

    @property
    def serves_hidden_states(self) -> bool:
        return self.settings.get("hidden_states", True) is not False

    def _validate(self) -> None:
        check_vllm_settings(
            self.settings,
            topk=self.spec.max_topk,
            max_logprobs=self.max_logprobs,
            hidden_states=self.settings.get("hidden_states") is True,
            engine=ENGINE,
        )

    def _stage_configs_path(self) -> str:
        given = engine_kwargs_of(self.spec, ENGINE).get("stage_configs_path")
        if given:
            return str(given)
        import yaml

        self._stage_dir = tempfile.TemporaryDirectory(prefix="proctor-omni-")
        path = Path(self._stage_dir.name) / f"{self.pipeline.name}_thinker.yaml"
        path.write_text(yaml.safe_dump(stage_config(self.spec, self.pipeline, self.max_logprobs)))
        return str(path)

    async def _start_engines(self) -> None:
        try:
            from vllm_omni.entrypoints import AsyncOmni
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise EngineError("inference.name=vllm_omni needs vLLM-Omni: pip install vllm-omni") from exc
        path = self._stage_configs_path()
        log.info("starting vLLM-Omni teacher %s with stage config %s", self.spec.model_path, path)
        self._omni = await asyncio.to_thread(
            AsyncOmni, model=str(self.spec.model_path), stage_configs_path=path, log_stats=False
        )

    async def close(self) -> None:
        self._closed = True
        omni, self._omni = self._omni, None
        if omni is not None:
            await asyncio.to_thread(omni.shutdown)
        if self._stage_dir is not None:
            self._stage_dir.cleanup()
            self._stage_dir = None

    async def check_health(self) -> bool:
        return self._omni is not None and not self._closed

    def sampling_params(self, topk: int):
        from vllm import SamplingParams

        return SamplingParams(**scoring_sampling_kwargs(topk))

    async def _score_one(self, request: EngineRequest) -> EngineResult:
        prompt = build_prompt(request)
        params = self.sampling_params(request.topk)
        final = None
        async for output in self._omni.generate(
            prompt, engine_request_id(request), sampling_params_list=[params]
        ):
            final = output
        if final is None:
            raise EngineError("vLLM-Omni returned no output")
        out = stage_output(final)
        result = EngineResult(first_row=request.first_row)
        if request.logprobs or request.topk:
            result.logprobs, result.topk_ids, result.topk_logprobs = extract_rows(
                out.prompt_logprobs, request.token_ids, request.first_row, request.topk, logprobs=request.logprobs
            )
        if request.hidden_states:
            states = extract_hidden(out, request.num_tokens)
            rows = hidden_rows(states, request.num_tokens, request.first_row)
            result.hidden_states = rows.to(device="cpu", dtype=self._dtype).contiguous()
        return result


def describe_stage_config(spec: EngineSpec) -> str:
    """The stage config proctor would write for spec, as JSON (for `proctor check-config`)."""
    pipeline = omni_pipeline(spec)
    from proctor.server.engines.vllm_common import resolve_max_logprobs

    return json.dumps(stage_config(spec, pipeline, resolve_max_logprobs(spec, ENGINE)), indent=2)
