"""A multimodal teacher replica on vLLM-Omni's AR pipeline (`AsyncOmni`): log-probs, top-k and
the Thinker's hidden states for prompts with images, audio and video.

(A little over 400 lines: the engine class itself, whose start-up deadline, stage watcher, abort
and score_ids paths each mirror a piece of vLLM-Omni's behaviour; its configuration and stage
bookkeeping already live in `omni_config` and `omni_stages`.)

Settings (`inference.engine_kwargs.vllm_omni`, as verl-omni writes them):
- `output_mode: "ar"` (required): the teacher runs the autoregressive Thinker only; no Talker,
  no Code2Wav (a teacher scores text tokens).
- `pipeline_name` (e.g. `qwen3_omni_moe`, `qwen2_5_omni`): selects the pipeline adapter, i.e.
  which architecture, HF sub-config and checkpoint names the Thinker has. Proctor writes a
  one-stage vLLM-Omni config for it (`deploy_config` / `stage_configs_path` override that file).
- `max_logprobs`: seeded from the teacher's top-k, validated against it.
- anything else is passed through to the Thinker stage's engine args.

Which vLLM-Omni this is written against (read from the released wheels, not the git tree):
0.30.0 (the CUDA image's pin) and 0.18.0 (the Ascend image's pin). They take different config
files, so proctor writes the one the installed version reads (`config_schema`):
- 0.30.0 refuses `stage_configs_path` (`entrypoints/utils.py:prepare_stage_config_inputs`) and
  the `stage_args` schema (`config/stage_config.py:load_deploy_config`); it takes
  `deploy_config=<yaml>` whose `pipeline:` names a registered topology
  (`config/pipeline_registry.py`: `qwen3_omni_moe_thinker_only`, `qwen2_5_omni_thinker_only`)
  and whose `stages[0]` holds the deployment knobs (`_parse_stage_deploy`; keys that are not
  `StageDeployConfig` fields land in `engine_extras`, which `_build_engine_args` applies last, so
  `engine_output_type: latent` overrides the thinker-only topology's "text").
- 0.18.0 reads the legacy `stage_args` YAML (`entrypoints/utils.py:load_stage_configs_from_yaml`).
Batch size: `runtime.max_batch_size` is the legacy knob; where vLLM-Omni still reads it, it
becomes `max_num_seqs` (0.18.0 `StageConfig.to_omegaconf`: setdefault from it, then default 1;
the Dec-2025 git tree's `omni_stage.py` even overwrote `max_num_seqs` with it, default 1). Proctor
never writes it and sets `max_num_seqs` itself: the teacher's `max_num_seqs`, else 256.

Scoring is the vLLM engine's: one prompt per sequence, `SamplingParams(max_tokens=1,
prompt_logprobs=K, detokenize=False)`, with `multi_modal_data` as the service decoded it
(`MultiModalInputs.decoded`) and `mm_processor_kwargs` exactly as the rollout sent them; the
token ids must already hold the expanded placeholders (what the rollout's processor produced and
vLLM generated from), and a result whose length differs is refused rather than misaligned.

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
- start-up: `init_timeout` / `stage_init_timeout` (both versions' `OmniBase.__init__`) get
  `EngineSpec.startup_timeout_s`, and the start is wrapped in the same deadline, so a stage that
  never becomes ready fails with an `EngineError` carrying the last vLLM-Omni log lines.

Hidden states: vLLM-Omni's AR model runner (`GPUARModelRunner` / `NPUARModelRunner`) attaches
to every scheduled chunk a payload `{"hidden": <last-layer activations of the chunk's tokens>}`
when the stage's `engine_output_type` is not "text" (it is "latent" here); the output processor
accumulates the chunks (renaming "hidden" to the stage's output type) into the request output's
`multimodal_output`. Those are the Thinker's text hidden states after its final norm, what its
`lm_head` consumes, so one engine serves log-probs and hidden states together; they are read
only for requests that ask for them. The cost is the runner's device→host copy of [T, H] per
request, paid whether or not the request wanted hidden states.

Why not the vLLM engine's scoring pooler (`vllm_scoring_model`): vLLM-Omni's entry point submits
generation requests only — `AsyncOmni.encode()` raises NotImplementedError ("encode() is not
implemented for AsyncOmni"), so no PoolingParams (and no per-request ask) reaches a stage — and
its AR model runner already uses `ModelRunnerOutput.pooler_output` for the stage's hidden-state
payload (`GPUARModelRunner.sample_tokens`), where a pooler's answer would have to travel. Read in
the newest vLLM-Omni source this project could fetch (v0.11.0rc1 + 138 commits); 0.30.0's wheel
was not inspectable here. So this engine keeps vLLM's prompt log-probs, the latent hidden
states, and score_ids from those (refused for a teacher whose logits are soft-capped or scaled).

vLLM-Omni needs CUDA or Ascend (no CPU platform) and pins its own transformers, so this engine
cannot run in CPU CI: tests/test_vllm_omni_engine.py runs it against tests/omni_fakes.py, whose
`FakeAsyncOmni` mirrors 0.30.0's behaviour with a real child process as the stage; everything it
shares with the vLLM engine (vllm_common.py) runs for real there. `bench/gpu_check.sh` runs it on
a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from proctor.server.engines.base import (
    EngineConfigError,
    EngineError,
    EngineRequest,
    EngineResult,
    EngineSpec,
    Outcome,
    RequestRejected,
)
from proctor.server.engines.checks import check_vllm_settings
from proctor.server.engines.multimodal import decoded_media
from proctor.server.engines.score_ids import scores_from_hidden
from proctor.server.engines.vllm.args import (
    engine_kwargs_of,
    engine_request_id,
    scoring_sampling_kwargs,
)
from proctor.server.engines.vllm.family import VllmFamilyEngine
from proctor.server.engines.vllm.media import VllmMedia
from proctor.server.engines.vllm_omni.config import (
    ENGINE,
    config_schema,
    deploy_config,
    omni_pipeline,
    stage_config,
)
from proctor.server.engines.vllm_omni.prompt_logprobs import extract_rows, hidden_rows
from proctor.server.engines.vllm_omni.stages import (
    LogTail,
    child_processes,
    classify_stage_error,
    process_exit,
)

log = logging.getLogger(__name__)

# Keys of the accumulated multimodal_output that hold the Thinker's hidden states, in order.
HIDDEN_KEYS = ("hidden", "latent", "latents", "model_outputs")
# How often the watcher looks at the stage processes, and how long health and abort may take.
STAGE_POLL_S = 0.5
HEALTH_TIMEOUT_S = 10.0
ABORT_TIMEOUT_S = 10.0
# Slack past the start-up deadline for vLLM-Omni's own init_timeout to fire first.
STARTUP_GRACE_S = 5.0


def build_prompt(request: EngineRequest, media_rule: VllmMedia | None = None) -> dict[str, Any]:
    """The TokensPrompt (a dict) for one request: ids, media as the service decoded it, processor
    kwargs as sent. With the model's placeholder rule (`vllm_media`; a checkpoint whose config
    names its placeholder tokens) each placeholder run is collapsed for the stage's processor to
    expand again; without one the ids go as sent and only their length is checked afterwards."""
    if media_rule is not None and media_rule.kinds:
        return media_rule.token_prompt(request)
    prompt: dict[str, Any] = {"prompt_token_ids": request.token_ids.tolist()}
    media = request.media
    if media:
        prompt["multi_modal_data"] = decoded_media(request)
        if media.processor_kwargs:
            prompt["mm_processor_kwargs"] = dict(media.processor_kwargs)
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


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


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
        from proctor.proto.versions import UnsupportedVersion, check_versions

        try:  # the releases this engine was written against (pyproject's `omni` extras)
            check_versions(["vllm-omni"], needed_by="inference.name=vllm_omni")
        except UnsupportedVersion as exc:
            raise EngineConfigError(str(exc)) from None
        try:
            from vllm_omni.entrypoints import AsyncOmni
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise EngineError("inference.name=vllm_omni needs vLLM-Omni: pip install vllm-omni") from exc
        return AsyncOmni

    def _config_schema(self) -> str:
        return config_schema()

    # -- lifecycle -------------------------------------------------------------------------
    def _config_kwargs(self) -> dict[str, str]:
        """`deploy_config=` or `stage_configs_path=` for AsyncOmni: the user's file, else ours."""
        schema = self._config_schema()
        key = "deploy_config" if schema == "deploy" else "stage_configs_path"
        given = engine_kwargs_of(self.spec, ENGINE).get(key)
        if given:
            return {key: str(given)}
        import yaml

        build = deploy_config if schema == "deploy" else stage_config
        self._stage_dir = tempfile.TemporaryDirectory(prefix="proctor-omni-")
        path = Path(self._stage_dir.name) / f"{self.pipeline.name}_thinker.yaml"
        path.write_text(yaml.safe_dump(build(self.spec, self.pipeline, self.max_logprobs)))
        return {key: str(path)}

    async def _start_engines(self) -> None:
        omni_cls = self._async_omni_class()
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
        before = set(child_processes())
        loop = asyncio.get_running_loop()
        tail = LogTail()
        with tail.attached():
            pending = loop.run_in_executor(None, lambda: omni_cls(**kwargs))
            try:
                self._omni = await asyncio.wait_for(asyncio.shield(pending), deadline + STARTUP_GRACE_S)
            except Exception as exc:
                if not pending.done():  # our deadline, not vLLM-Omni's own error
                    self._abandon_start(pending, before)
                    raise EngineError(
                        f"vLLM-Omni did not become ready within {deadline:.0f}s (startup_timeout_s); "
                        f"last log lines:\n{tail.text()}"
                    ) from exc
                self._kill_new_children(before)
                raise EngineError(
                    f"vLLM-Omni failed to start: {type(exc).__name__}: {exc}; last log lines:\n{tail.text()}"
                ) from exc
        self._stage_procs = {pid: p for pid, p in child_processes().items() if pid not in before}
        if not self._stage_procs:
            log.warning("vLLM-Omni started no stage process visible to proctor: only its own health checks apply")
        self._death = loop.create_future()
        self._watcher = asyncio.create_task(self._watch_stages(), name="vllm-omni-stage-watcher")

    def _abandon_start(self, pending: asyncio.Future, before: set[int]) -> None:
        """A start past its deadline: kill the stage processes it spawned and shut the engine
        down should its constructor still return."""

        def _late(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                with contextlib.suppress(Exception):
                    done.result().shutdown()

        pending.add_done_callback(_late)
        self._kill_new_children(before)

    @staticmethod
    def _kill_new_children(before: set[int]) -> None:
        for pid, process in child_processes().items():
            if pid not in before:
                with contextlib.suppress(Exception):
                    process.kill()

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
    def sampling_params(self, topk: int):
        from vllm import SamplingParams

        return SamplingParams(**scoring_sampling_kwargs(topk))

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
        result = self._result(request, final)
        if request.score_ids is not None and isinstance(result, EngineResult):
            result.score_logprobs = await asyncio.to_thread(self._score_ids_from_hidden, request, final)
        return result

    def _score_ids_from_hidden(self, request: EngineRequest, final: Any) -> torch.Tensor:
        """score_ids from the AR stage's hidden states (its latent output, which every request
        carries here) and the Thinker's lm_head rows, normalised by the actual token's log-prob:
        the stage has no fixed-token scoring of its own (`score_ids.scores_from_hidden`)."""
        out = stage_output(final)
        actual, _, _ = extract_rows(out.prompt_logprobs, request.token_ids, request.first_row, request.topk)
        states = hidden_rows(extract_hidden(out, request.num_tokens), request.num_tokens, request.first_row)
        return scores_from_hidden(states, self.unembedding(), request.score_ids,
                                  request.token_ids[request.first_row :], actual)

    async def _until_stage_dies(self, consumer: asyncio.Future) -> Any:
        """The consumer's result, unless a stage process dies first (EngineError, consumer cancelled)."""
        death = self._death
        if death is None:
            return await consumer
        done, _ = await asyncio.wait({consumer, death}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            return consumer.result()
        consumer.cancel()
        raise EngineError(death.result())

    async def _final_output(self, request: EngineRequest, engine_id: str) -> Any:
        final = None
        async for output in self._omni.generate(
            build_prompt(request, self._media), engine_id, sampling_params_list=[self.sampling_params(request.topk)]
        ):
            final = output
        return final

    def _result(self, request: EngineRequest, final: Any) -> EngineResult | RequestRejected:
        if final is None:
            raise EngineError("vLLM-Omni returned no output")
        out = stage_output(final)
        completions = list(getattr(out, "outputs", None) or [])
        if completions and getattr(completions[0], "finish_reason", None) == "abort":
            raise asyncio.CancelledError  # 0.30.0's terminal abort output: an aborted request
        positions = getattr(out, "prompt_logprobs", None)
        if request.media and self._media.kinds:  # the stage's expansion must be the ids sent
            try:
                self._media.check_expansion(request, getattr(out, "prompt_token_ids", None))
            except RequestRejected as problem:
                return problem
        elif request.media and positions is not None and len(positions) != request.num_tokens:
            return RequestRejected(
                "token_ids",
                f"the processor expanded the prompt to {len(positions)} tokens from {request.num_tokens}: "
                "send the token ids with the media placeholders already expanded",
                request_id=request.request_id,
            )
        result = EngineResult(first_row=request.first_row)
        if request.logprobs or request.topk:
            result.logprobs, result.topk_ids, result.topk_logprobs = extract_rows(
                positions, request.token_ids, request.first_row, request.topk, logprobs=request.logprobs
            )
        if request.hidden_states:
            states = extract_hidden(out, request.num_tokens)
            rows = hidden_rows(states, request.num_tokens, request.first_row)
            result.hidden_states = rows.to(device="cpu", dtype=self._dtype).contiguous()
        return result
