"""Fakes of vLLM-Omni for tests/test_vllm_omni_engine.py (vLLM-Omni has no CPU platform).

`FakeAsyncOmni` mirrors vLLM-Omni 0.30.0 (the CUDA image's pin; read from its released wheel)
where proctor depends on it, with a real child process as the Thinker stage so that a SIGKILL
is a real fault:
- construction: `entrypoints/utils.py:prepare_stage_config_inputs` refuses `stage_configs_path`;
  `config/stage_config.py:load_deploy_config` refuses the `stage_args` schema;
  `OmniBase.__init__` takes `init_timeout` and `AsyncOmniEngine` raises
  `TimeoutError("Orchestrator did not become ready within Ns")` past it (`hang_init=True`
  instead mirrors a start that never returns, as the Dec-2025 git tree's
  `_wait_for_stages_ready` did).
- batch size: `_parse_stage_deploy` / `StageDeployConfig.max_num_seqs` (stage key; a
  `runtime.max_batch_size` is not read in this schema); the stage admits at most that many
  sequences at once. `legacy_max_num_seqs` mirrors 0.18.0's `StageConfig.to_omegaconf`.
- config front door (`resolve_config`, checked against the real one by
  tests/test_vllm_omni_engine.py through support/omni_config_check.py): `stage_configs_path` and the
  `stage_args` schema refused; a stage key no structured config owns (`engine_output_type`,
  `disable_log_stats`) refused; the thinker-only topology's engine_output_type is "latent".
- output: 0.30.0's `OmniRequestOutput` is a flat vLLM `RequestOutput`; hidden states only where
  the Thinker declares them a client output (`_output`).
- `generate`: `AsyncOmni.generate` suffixes the request id with a uuid, processes inputs in the
  caller (vLLM's `ValueError` for a prompt over max_model_len, its `RuntimeError` for a
  placeholder count mismatch), and on `CancelledError` aborts the request; stage errors arrive
  as an `ErrorMessage` and are raised by `_raise_nonfatal_error_message` /
  `_check_engine_output_error` as `OmniClientError` (4xx) or `EngineGenerateError`; a fatal one
  as `OmniEngineDeadError`.
- `abort`: `AsyncOmni.abort` maps external ids to internal ones, the stage drops them, and
  `AsyncOmniBase._abort` delivers a terminal output with `finish_reason="abort"`.
- `check_health`: `OmniBase.check_health` (orchestrator alive, replica not flagged dead); the
  flag comes from a monitor, off by default (`monitor_detects_death=False`): the window in
  which a SIGKILLed stage is not yet flagged (and the git tree's empty `check_health`).
Marker tokens in a prompt steer the stage: SLOW runs ~forever, CLIENT_ERROR / ENGINE_ERROR make
the stage report a 400 / an engine error for that request; IMAGE is the image placeholder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import time
import uuid
from collections import deque
from types import SimpleNamespace
from typing import Any, ClassVar

import yaml

log = logging.getLogger("vllm_omni.fake")
log.setLevel(logging.INFO)  # vllm_omni's init_logger logs at INFO

IMAGE, SLOW, CLIENT_ERROR, ENGINE_ERROR = 99, 96, 98, 97
HIDDEN = 4
FAKE_MAX_NUM_SEQS_DEFAULT = 256  # vLLM's own default when the deploy file sets none
TOPOLOGY_OUTPUT_TYPE = "latent"  # the thinker-only pipelines' engine_output_type
# Stage keys no structured config of 0.30.0 owns, among those proctor ever wrote.
UNOWNED_STAGE_KEYS = frozenset({"engine_output_type", "disable_log_stats"})


def resolve_config(key: str, path: str) -> dict[str, Any]:
    """What 0.30.0's config front door makes of `key=path` (`support/omni_config_check.py` runs
    the real one: `prepare_stage_config_inputs`, `load_deploy_config`, the stage ownership check),
    as that script reports it: {"error": message} or the stage's resolved settings."""
    if key != "deploy_config":
        return {"error": f"`{key}` is no longer supported; use `deploy_config` instead."}
    config = yaml.safe_load(open(path))  # noqa: SIM115
    if "stage_args" in config:
        return {"error": f"Deploy config {path} uses the removed `stage_args` schema; "
                         "define topology in PipelineConfig and deployment overrides under `stages`."}
    (stage,) = config["stages"]
    unowned = sorted(UNOWNED_STAGE_KEYS & set(stage))
    if unowned:
        return {"error": f"Stage 0 (llm_ar) has explicit engine argument(s) with no structured config owner: "
                         f"{', '.join(unowned)}"}
    return {"engine_output_type": TOPOLOGY_OUTPUT_TYPE,
            "max_num_seqs": int(stage.get("max_num_seqs") or FAKE_MAX_NUM_SEQS_DEFAULT),
            "max_logprobs": stage.get("max_logprobs")}


class OmniClientError(ValueError):
    """0.30.0 `vllm_omni/errors.py:OmniClientError`."""

    def __init__(self, message: str, *, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


class EngineGenerateError(Exception):
    """vLLM's `EngineGenerateError` (0.30.0's fallback for a non-client stage error)."""


class EngineDeadError(Exception):
    """vLLM's `EngineDeadError`."""


class OmniEngineDeadError(EngineDeadError):
    """0.30.0 `entrypoints/omni_base.py:OmniEngineDeadError`."""


def legacy_max_num_seqs(stage: dict[str, Any]) -> int:
    """0.18.0 `StageConfig.to_omegaconf`: max_num_seqs from runtime.max_batch_size, else 1."""
    args = dict(stage.get("engine_args") or {})
    mbs = (stage.get("runtime") or {}).get("max_batch_size")
    if mbs is not None:
        args.setdefault("max_num_seqs", int(mbs or 1))
    args.setdefault("max_num_seqs", 1)
    return int(args["max_num_seqs"])


def _stage_main(cmd_q: Any, out_q: Any, max_num_seqs: int, ready: bool, step_s: float) -> None:
    """The stage process: admits up to max_num_seqs sequences, steps them, reports outcomes."""
    if not ready:
        while True:  # never becomes ready
            time.sleep(1)
    out_q.put(("ready", os.getpid()))
    waiting: deque = deque()
    running: dict[str, list] = {}
    peak = 0
    while True:
        try:
            while True:
                cmd = cmd_q.get(timeout=step_s) if not (running or waiting) else cmd_q.get_nowait()
                if cmd[0] == "stop":
                    return
                if cmd[0] == "add":
                    waiting.append(cmd[1:])
                elif cmd[0] == "abort":
                    for rid in cmd[1]:
                        hit = running.pop(rid, None) is not None
                        queued = [w for w in waiting if w[0] == rid]
                        for w in queued:
                            waiting.remove(w)
                        if hit or queued:
                            out_q.put(("aborted", rid))
        except queue.Empty:
            pass
        while waiting and len(running) < max_num_seqs:
            rid, ids = waiting.popleft()
            running[rid] = [10**6 if SLOW in ids else 3, ids]
        peak = max(peak, len(running))
        for rid in list(running):
            running[rid][0] -= 1
            if running[rid][0] <= 0:
                ids = running.pop(rid)[1]
                if CLIENT_ERROR in ids:
                    out_q.put(("error", rid, "stage rejected the request's audio features", 400))
                elif ENGINE_ERROR in ids:
                    out_q.put(("error", rid, "CUDA error: an illegal memory access was encountered", None))
                else:
                    out_q.put(("done", rid, ids, peak))
        time.sleep(step_s)


class FakeAsyncOmni:
    """vLLM-Omni 0.30.0's AsyncOmni as proctor uses it (see the module docstring)."""

    hang_init = False  # never return from __init__ (ignores init_timeout)
    stage_ready = True
    monitor_detects_death = False
    step_s = 0.005
    stage_max_model_len: int | None = None  # the stage's own limit, when it differs from the file's
    image_tokens = 0  # tokens the stage's processor makes of each IMAGE placeholder (0: none added)
    instances: ClassVar[list[FakeAsyncOmni]] = []

    def __init__(self, model: str = "", *, deploy_config: str | None = None, stage_configs_path: str | None = None,
                 init_timeout: int = 600, stage_init_timeout: int = 300, log_stats: bool = False) -> None:
        key, path = ("stage_configs_path", stage_configs_path) if stage_configs_path else ("deploy_config", deploy_config)
        resolved = resolve_config(key, path)
        if "error" in resolved:
            raise ValueError(resolved["error"])
        self.kwargs = {"model": model, "init_timeout": init_timeout, "stage_init_timeout": stage_init_timeout}
        self.config = yaml.safe_load(open(path))  # noqa: SIM115
        (stage,) = self.config["stages"]
        self.max_num_seqs = resolved["max_num_seqs"]
        self.max_model_len = int(self.stage_max_model_len or stage.get("max_model_len") or 1 << 20)
        self.engine_output_type = resolved["engine_output_type"]
        ctx = mp.get_context("fork")
        self._cmd_q, self._out_q = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(
            target=_stage_main, args=(self._cmd_q, self._out_q, self.max_num_seqs, self.stage_ready, self.step_s),
            daemon=True,
        )
        self._proc.start()
        FakeAsyncOmni.instances.append(self)
        self.request_states: dict[str, SimpleNamespace] = {}
        self.stage_aborted: list[str] = []
        self.received_prompts: list[dict] = []
        self.stage_peak = 0
        self._engine_dead = False
        self._pump: asyncio.Task | None = None
        log.info("[Stage-0] starting Thinker engine core (pid %s)", self._proc.pid)
        deadline = time.monotonic() + init_timeout
        while True:
            try:
                self._out_q.get(timeout=0.05)
                break
            except queue.Empty:
                log.info("[Orchestrator] waiting for stage-0 to become ready")
                if not self._proc.is_alive():
                    raise RuntimeError(f"stage-0 process exited with {self._proc.exitcode} during init") from None
                if not self.hang_init and time.monotonic() > deadline:
                    raise TimeoutError(f"Orchestrator did not become ready within {init_timeout}s") from None

    @property
    def stage_pid(self) -> int:
        return self._proc.pid

    # -- the orchestrator's output pump -------------------------------------------------------
    async def _pump_outputs(self) -> None:
        while True:
            if self.monitor_detects_death and not self._proc.is_alive():
                self._engine_dead = True
                for state in self.request_states.values():
                    state.queue.put_nowait(("dead", "Stage-0 has no live replica"))
                return
            try:
                msg = self._out_q.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.002)
                continue
            if msg[0] == "aborted":
                self.stage_aborted.append(msg[1])
            if msg[0] == "done":
                self.stage_peak = max(self.stage_peak, msg[3])
            state = self.request_states.get(msg[1])
            if state is not None:
                state.queue.put_nowait(msg)

    # -- EngineClient --------------------------------------------------------------------------
    async def generate(self, prompt: dict, request_id: str = "", *, sampling_params_list: list | None = None):
        internal = f"{request_id}-{uuid.uuid4().hex[:8]}"
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._pump_outputs())
        state = SimpleNamespace(queue=asyncio.Queue(), external=request_id)
        self.request_states[internal] = state
        try:
            ids = list(prompt["prompt_token_ids"])
            self.received_prompts.append(prompt)
            self._process_inputs(ids, prompt)
            ids = self._expand_placeholders(ids)
            self._cmd_q.put(("add", internal, ids))
            while True:
                msg = await state.queue.get()
                if msg[0] == "dead":
                    raise OmniEngineDeadError(msg[1])
                if msg[0] == "error":
                    if msg[3] is not None and 400 <= msg[3] < 500:
                        raise OmniClientError(msg[2], status_code=msg[3])
                    raise EngineGenerateError(msg[2])
                if msg[0] == "aborted":
                    yield _output(request_id, ids, 0, None, finish_reason="abort")
                    return
                if msg[0] == "done":
                    topk = sampling_params_list[0].prompt_logprobs if sampling_params_list else 0
                    yield _output(request_id, ids, topk, self.engine_output_type)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self._cmd_q.put(("abort", [internal]))
            raise
        finally:
            self.request_states.pop(internal, None)

    def _process_inputs(self, ids: list[int], prompt: dict) -> None:
        """vLLM's InputProcessor checks, run in the caller as 0.30.0 does."""
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        for image in images:
            if isinstance(image, bytes | bytearray):
                raise ValueError("image: expected a decoded image, got bytes")
        found = ids.count(IMAGE)
        if found != len(images):
            raise RuntimeError(
                f"Expected there to be {len(images)} prompt updates corresponding to {len(images)} image items, "
                f"but instead found {found} prompt updates! This is likely because you forgot to include "
                "input placeholder tokens (e.g., `<image>`, `<|image_pad|>`) in the prompt."
            )

    def _expand_placeholders(self, ids: list[int]) -> list[int]:
        """vLLM's prompt updates on a token prompt: each IMAGE token becomes the image's
        `image_tokens` placeholder tokens (0: the fake leaves the ids as sent)."""
        if not self.image_tokens:
            return ids
        return [t for token in ids for t in ([token] * self.image_tokens if token == IMAGE else [token])]

    async def abort(self, request_id: str | list[str]) -> None:
        wanted = {request_id} if isinstance(request_id, str) else set(request_id)
        internal = [rid for rid, s in self.request_states.items() if s.external in wanted]
        if internal:
            self._cmd_q.put(("abort", internal))

    async def check_health(self) -> None:
        if self._pump is not None and self._pump.done() and not self._engine_dead:
            raise EngineDeadError("Orchestrator process is not alive")
        if self._engine_dead:
            raise EngineDeadError("Stage-0 has no live replica")

    def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        with contextlib.suppress(Exception):
            self._cmd_q.put(("stop",))
        self._proc.join(timeout=2)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=2)


def _output(request_id: str, ids: list[int], topk: int, output_type: str | None, finish_reason: str = "length"):
    """An OmniRequestOutput of 0.30.0: a vLLM RequestOutput itself (flat prompt logprobs), whose
    completion carries the accumulated multimodal output. The AR runner sends the hidden-state
    payload of a final stage only when the model declares it a client output (proctor's
    vllm_omni.general_plugins declaration, made where `adapter.HIDDEN_STATES_ENV` is set), and the
    output processor files it under the stage's engine_output_type."""
    import torch
    from vllm.logprobs import FlatLogprobs

    from proctor.server.engines.vllm_omni.adapter import HIDDEN_STATES_ENV

    flat = FlatLogprobs()
    flat.append(None)
    for i in range(1, len(ids)):
        cands = [ids[i], 7, 8][: topk + 1]
        flat.append_fast(cands, [-float(i), -0.1, -0.2][: topk + 1], iter([3, 1, 2][: topk + 1]), [None] * (topk + 1))
    payload = None
    if output_type is not None and os.environ.get(HIDDEN_STATES_ENV) == "1":
        payload = {output_type: torch.arange(len(ids) * HIDDEN, dtype=torch.float32).reshape(len(ids), HIDDEN)}
    completion = SimpleNamespace(multimodal_output=payload, finish_reason=finish_reason, token_ids=[1])
    return SimpleNamespace(request_id=request_id, stage_id=0, final_output_type="text", finished=True,
                           prompt_logprobs=flat if finish_reason != "abort" else None, prompt_token_ids=ids,
                           outputs=[completion], multimodal_output=payload or {})


def fake_omni(**options: Any) -> type[FakeAsyncOmni]:
    """A FakeAsyncOmni subclass with the given class options (hang_init, stage_ready, ...)."""
    return type("FakeAsyncOmniVariant", (FakeAsyncOmni,), dict(options))
