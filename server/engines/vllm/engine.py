"""A teacher replica on one vLLM engine: every output scored on the device, in one prefill.

The replica runs one `AsyncLLM` on vLLM's pooling runner with proctor's scoring model
(`vllm.scoring_model`: the teacher's own architecture, registered through vLLM's plugin entry
point and selected with `hf_overrides`). Each sequence is one `encode` of its token ids with
`PoolingParams(task=SCORING_TASK, extra_kwargs=<its ScoreAsk>)`; in the same forward pass the
pooler computes, next to the model's own logits (its `compute_logits`: lm_head, bias, logit
scale, soft-cap, the TP gather), the actual token's log-prob and true rank, the top-k, the
log-probs at `score_ids`, all at the request's temperature, and the hidden states when asked,
for rows `first_row..T-1` only. Its answer is one compact tensor (`pooled_scores`); no `[T, V]`
leaves the device. So one copy of the weights and one KV cache serve every output, temperature
applies on this engine, and score_ids are exact (the full log-softmax, not a re-derived head).

A pooled sequence needs no output slot, so a sequence may be `max_model_len` tokens long.
Chunked prefill works: the pooler keeps each chunk's outputs in the request's pooling state and
packs them after the last chunk. Shared prompts read vLLM's prefix cache (`vllm.prefix`), and
every answer says which rows the pooler computed, so a row inside a cached prefix is never read.
Everything the replica serves is up before it reports ready: `start` builds the one engine,
within `startup_timeout_s` (the worker enforces it and fails the replica with the log tail).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import torch

from proctor.proto.hidden_forms import PROJECTED_FORMS
from proctor.server.engines.base import (
    EngineConfigError,
    EngineError,
    EngineRequest,
    EngineResult,
    RequestFailed,
)
from proctor.server.engines.checkpoint import check_cpu_head_dim, model_facts
from proctor.server.engines.checks import check_vllm_settings
from proctor.server.engines.prompt_reuse import ReuseSettings
from proctor.server.engines.row_scores import score_rows
from proctor.server.engines.token_ids import index_tensor
from proctor.server.engines.vllm.adapter import SCORING_TASK, check_vllm_version, engine_classes
from proctor.server.engines.vllm.args import engine_args_from_settings, engine_kwargs_of, engine_request_id
from proctor.server.engines.vllm.errors import input_error
from proctor.server.engines.vllm.family import PROBE_TIMEOUT_S, VllmFamilyEngine
from proctor.server.engines.vllm.media import VllmMedia
from proctor.server.engines.vllm.pooled_scores import PooledScores, ScoreAsk, unpack
from proctor.server.engines.vllm.prefix import KeptRow, PrefixLane, kept_row
from proctor.server.engines.vllm.scoring_model import scoring_architecture

log = logging.getLogger(__name__)

SCORE_IDS_METHOD = "pooler"  # ListTeachers: score_ids from the on-device log-softmax


def base_architecture(model_path: str) -> str:
    """The checkpoint's architecture (config.json), which proctor's scoring model wraps."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not architectures:
        raise EngineError(f"{model_path}/config.json names no architectures: vLLM cannot load it")
    return str(architectures[0])


class VllmEngine(VllmFamilyEngine):
    """One teacher replica: one pooling AsyncLLM running proctor's scoring model."""

    engine_name = "vllm"
    temperature = True

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self._llm = None
        self._media = VllmMedia(spec.model_path)  # a multimodal teacher's placeholder rule
        self.media_kinds = self._media.kinds
        self._reuse = ReuseSettings.from_inference(spec.inference)
        self._lane: PrefixLane | None = None  # shared prompts in the prefix cache, once running

    # -- lifecycle -------------------------------------------------------------------------
    def _validate(self) -> None:
        check_vllm_version()
        own = engine_kwargs_of(self.spec, self.engine_name)
        if "hidden_states_gpu_memory_utilization" in own:
            raise EngineConfigError(
                "inference.engine_kwargs.vllm.hidden_states_gpu_memory_utilization: there is no second engine for "
                "hidden states any more (one engine serves every output); remove it and size gpu_memory_utilization")
        if own.get("score_ids_method") not in (None, "", "auto", SCORE_IDS_METHOD):
            raise EngineConfigError(
                f"inference.engine_kwargs.vllm.score_ids_method is {own['score_ids_method']!r}: the vLLM engine scores "
                f"score_ids in its pooler only; use auto or {SCORE_IDS_METHOD!r}")
        check_vllm_settings(self.settings, topk=self.spec.max_topk, max_logprobs=self.max_logprobs,
                            hidden_states=False)
        check_cpu_head_dim(model_facts(self.spec.model_path), self.spec.device)

    def _engine_args(self) -> dict[str, Any]:
        args = engine_args_from_settings(self.spec, max_logprobs=self.max_logprobs,
                                         prefix_caching=self._reuse.enabled)
        if args.get("max_model_len") is None:
            args["max_model_len"] = self.facts.max_position_embeddings or None
        overrides = dict(args.pop("hf_overrides", None) or {})
        overrides["architectures"] = [scoring_architecture(base_architecture(self.spec.model_path))]
        args.update(runner="pooling", convert="none", hf_overrides=overrides)
        return args

    async def _start_engines(self) -> None:
        args = self._engine_args()
        log.info("starting vLLM teacher %s: %s", self.spec.model_path, args)
        self._llm = await asyncio.to_thread(self._build, args)
        if self._reuse.enabled and self._llm.vllm_config.cache_config.enable_prefix_caching:
            self._lane = PrefixLane(self._reuse)

    def _build(self, args: dict[str, Any]):
        """An AsyncLLM for args; on the replica's Ray placement group when it has one."""
        AsyncEngineArgs, AsyncLLM, _, _ = engine_classes()
        if self.spec.placement_group is None:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        args = {**args, "distributed_executor_backend": "ray"}
        vllm_config = AsyncEngineArgs(**args).create_engine_config()
        vllm_config.parallel_config.placement_group = self.spec.placement_group
        return AsyncLLM.from_vllm_config(vllm_config)

    async def _engine_max_model_len(self) -> int:
        return int(self._llm.model_config.max_model_len)

    def _max_sequence(self, max_model_len: int) -> int:
        return max_model_len  # a pooled prefill generates nothing: no output slot

    def _choose_score_ids_method(self) -> str:
        return SCORE_IDS_METHOD

    async def close(self) -> None:
        self._closed = True
        self.forms.close()
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    async def check_health(self) -> bool:
        llm = self._llm
        if llm is None or self._closed or llm.errored:
            return False
        try:
            await asyncio.wait_for(llm.engine_core.is_sleeping_async(), PROBE_TIMEOUT_S)
        except Exception:  # no answer in time, or the core is gone
            return False
        return True

    # -- scoring ---------------------------------------------------------------------------
    async def _score_one(self, request: EngineRequest) -> EngineResult:
        if self._lane is not None and self._reuse.applies(request):
            return await self._lane.run(request, self)
        answer = await self.encode(request, read_cache=False)
        result = self.computed_rows(request, answer)
        result.computed_tokens = answer.positions
        return result

    def _ask(self, request: EngineRequest, *, keep_row: int = 0) -> ScoreAsk:
        score_ids = b"" if request.score_ids is None else request.score_ids.tobytes()  # int32, row-major
        return ScoreAsk(
            first_row=request.first_row,
            scores=bool(request.logprobs or request.topk or request.score_ids is not None),
            topk=int(request.topk),
            temperature=float(request.temperature),
            hidden=bool(request.hidden_states),
            score_ids=score_ids,
            score_k=0 if request.score_ids is None else int(request.score_ids.shape[1]),
            keep_row=keep_row,
            hidden_form=request.hidden_form,
            projection=self.forms.projection_file() if request.hidden_form in PROJECTED_FORMS else "",
            ranks=bool(request.logprobs and request.ranks),
        )

    async def encode(self, request: EngineRequest, *, read_cache: bool, keep_row: int = 0) -> PooledScores:
        """One pooled prefill of the request; `read_cache` lets vLLM skip its cached prefix,
        `keep_row` asks the pooler to keep that row's raw logits and hidden state."""
        _, _, PoolingParams, _ = engine_classes()
        params = PoolingParams(task=SCORING_TASK, extra_kwargs=self._ask(request, keep_row=keep_row).to_kwargs(),
                               skip_reading_prefix_cache=not read_cache)
        try:  # media: collapsed, expanded, checked (vLLM's processor runs on the request's own items)
            prompt = await self._media.rendered(self._llm, request)
        except Exception as exc:
            outcome = input_error(request, exc)
            if outcome is exc:
                raise
            raise outcome from exc
        final = await self._final(self._llm.encode(prompt, params, request_id=engine_request_id(request)))
        return _answer(final)

    async def prefix_row(self, request: EngineRequest, length: int) -> tuple[KeptRow, int]:
        """Row `length`'s raw logits and hidden state from the request's first `length` tokens alone
        (their last position is always computed), and the positions that took."""
        _, _, PoolingParams, TokensPrompt = engine_classes()
        ask = ScoreAsk(first_row=length, scores=False, keep_row=length)
        params = PoolingParams(task=SCORING_TASK, extra_kwargs=ask.to_kwargs(), skip_reading_prefix_cache=False)
        salt = {"cache_salt": request.cache_salt} if request.cache_salt else {}
        prompt = TokensPrompt(prompt_token_ids=request.token_ids[:length].tolist(), **salt)
        final = await self._final(self._llm.encode(prompt, params, request_id=f"{engine_request_id(request)}-p{length}"))
        answer = _answer(final)
        row = kept_row(answer)
        if row is None:
            raise RequestFailed("vLLM's answer for a prefix alone lacks its last position's row")
        return row, answer.positions

    @staticmethod
    async def _final(outputs):
        final = None
        async for output in outputs:
            final = output
        if final is None:
            raise RequestFailed("vLLM returned no output")
        return final

    def computed_rows(self, request: EngineRequest, pooled: PooledScores) -> EngineResult:
        """The rows the pooler computed (`pooled.first_row`..T-1, at least the request's first row
        on), as the request asked them."""
        start = pooled.first_row
        if start < request.first_row or pooled.n != request.num_tokens - start:
            raise RequestFailed(f"vLLM's scoring answer holds rows {pooled.first_row}..+{pooled.n}, "
                              f"expected {start}..{request.num_tokens - 1}")
        result = EngineResult(first_row=start)
        _fill(result, request, pooled, self._dtype)
        return result

    def kept_row(self, request: EngineRequest, row: KeptRow, index: int) -> EngineResult:
        """Row `index` of the request from the raw logits kept at position index-1, by the same rule
        the pooler scores by."""
        target = index_tensor(request.token_ids[index : index + 1])
        temperatures = None if request.temperature == 1.0 else torch.tensor([request.temperature])
        offset = index - request.first_row
        score_ids = None if request.score_ids is None else index_tensor(request.score_ids[offset : offset + 1])
        scores = score_rows(lambda h: h, row.logits[None], target, topk=request.topk,
                            temperatures=temperatures, score_ids=score_ids, ranks=request.ranks)
        pooled = PooledScores(index, 1, scores.logprobs, scores.ranks, scores.topk_ids, scores.topk_logprobs,
                              scores.score_logprobs,
                              self.forms.compress(row.hidden[None].to(self._dtype), request.hidden_form), None, None)
        result = EngineResult(first_row=index)
        _fill(result, request, pooled, self._dtype)
        return result


def _answer(final) -> PooledScores:
    """One request's pooled answer. What is wrong with it is that request's fault (RequestFailed:
    INTERNAL for it, retried once elsewhere, counted toward the replica's health), never by itself
    a replica failure: one odd answer must not restart replicas."""
    try:
        pooled = unpack(final.outputs.data)
    except ValueError as exc:
        raise RequestFailed(f"vLLM's scoring answer is malformed: {exc}") from exc
    return pooled


def _fill(result: EngineResult, request: EngineRequest, pooled: PooledScores, dtype: torch.dtype) -> None:
    """The asked outputs of `request` from one pooled answer (copies: the answer's views share its bytes)."""

    def field(name: str) -> torch.Tensor:
        value = getattr(pooled, name)
        if value is None:
            raise RequestFailed(f"vLLM's scoring answer lacks {name}")
        return value.clone()

    if request.logprobs:
        result.logprobs = field("logprobs")
        if request.ranks:
            result.ranks = field("ranks").to(torch.int64)
    if request.topk:
        result.topk_ids, result.topk_logprobs = field("topk_ids"), field("topk_logprobs")
    if request.score_ids is not None:
        result.score_logprobs = field("score_logprobs")
    if request.hidden_states:
        hidden = field("hidden")  # in the request's form, or the model's dtype
        result.hidden_states = hidden if request.hidden_form else hidden.to(dtype)
