"""The plain PyTorch teacher: a transformers causal LM, exact, on CPU, CUDA or Ascend NPU.

A batch becomes one right-padded forward pass through the decoder body; the `lm_head` then
runs only on the rows that were asked for (response rows), in row chunks, so that a long
prompt costs no `[T, V]` logits and a large vocabulary never needs all rows' logits at once.
Right padding leaves every real position's result unchanged (causal attention never looks
right), so batching changes results only by float rounding.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import numpy as np
import torch

from proctor.proto import torch_dtype
from proctor.server.engines.base import (
    DEFAULT_TOKEN_BUDGET,
    EngineConfigError,
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineResult,
    EngineSpec,
    Outcome,
    RequestRejected,
    TeacherEngine,
    serving_dtype,
    started_info,
)
from proctor.server.engines.checks import check_device
from proctor.server.engines.fingerprint import model_fingerprint
from proctor.server.engines.hidden_forms import HiddenForms
from proctor.server.engines.invariance import batch_invariant, invariant_spec
from proctor.server.engines.logit_transforms import LogitTransforms, logit_transforms
from proctor.server.engines.multimodal import check_counts
from proctor.server.engines.prompt_reuse import ReuseSettings
from proctor.server.engines.row_scores import score_rows
from proctor.server.engines.teacher_serves import request_problem
from proctor.server.engines.torch import invariant
from proctor.server.engines.torch.loading import build
from proctor.server.engines.torch.media import PreparedMedia, TorchMedia, is_multimodal, load_multimodal_model
from proctor.server.engines.torch.prefix import (
    PrefixPass,
    ReusePlan,
    TorchPrefix,
    batch_cache,
    supports_prompt_cache,
)
from proctor.server.engines.torch.reuse_probe import reuse_works

log = logging.getLogger(__name__)

# transformers resolves its lazy attributes on first touch, which is not thread-safe: two
# replicas loading at once on worker threads can see ImportError for AutoConfig. One lock.
_IMPORT_LOCK = threading.Lock()


def resolve_device(device: str) -> torch.device:
    """Turn "cpu" / "cuda[:N]" / "npu[:N]" into a torch device, once `checks.check_device` allows it
    (which imports torch_npu, registering the "npu" device type)."""
    try:
        check_device(device)
    except EngineConfigError as exc:
        raise EngineError(str(exc)) from None
    return torch.device(device)


def _row_temperatures(batch: list[EngineRequest], device: torch.device) -> torch.Tensor | None:
    """Each row's temperature, in the row order of the batch's lm_head pass (float32 [rows]);
    None when every request is at T = 1, so the common case pays no division."""
    if all(r.temperature == 1.0 for r in batch):
        return None
    return torch.cat([torch.full((r.num_rows,), r.temperature, dtype=torch.float32) for r in batch]).to(device)


class TorchEngine(TeacherEngine):
    """A transformers model in this process; one forward pass per batch, on a worker thread."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = invariant_spec(spec)  # batch-invariant: checked, prompt reuse off
        self._invariant = batch_invariant(self.spec.inference)
        self._model = None
        self._info: EngineInfo | None = None
        self._lock = threading.Lock()
        self.forward_passes = 0  # observable batching: how many forward passes ran
        inference = spec.inference or {}
        self._max_model_len = inference.get("max_model_len")
        self._budget = int(inference.get("max_num_batched_tokens") or DEFAULT_TOKEN_BUDGET)
        self._prefix: TorchPrefix | None = None  # shared prompts' KV caches (set at load)
        self._media: TorchMedia | None = None  # a multimodal teacher's processor (set at load)
        self._transforms = LogitTransforms()  # the model's final-logit transforms (set at load)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        with _IMPORT_LOCK:
            from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(self.spec.model_path)
        if not (path / "config.json").exists():
            raise EngineError(f"model_path {str(path)!r} is not a model directory (no config.json)")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        dtype = torch_dtype(serving_dtype(self.spec.dtype, getattr(config, "dtype", None)))
        device = resolve_device(self.spec.device)
        if is_multimodal(path):  # a VL model or an Omni Thinker: its processor scores the media
            self._media = TorchMedia(path)
            model = load_multimodal_model(path, config, dtype)
        else:
            model = build(AutoModelForCausalLM.from_pretrained, path, local_files_only=True, dtype=dtype)
        model.to(device).eval()
        self._transforms = logit_transforms(config)
        if self._media is None:
            check_own_logits(model, self._transforms)
        self._model = model
        reuse = ReuseSettings.from_inference(self.spec.inference)
        # The reuse path is probed on a tiny input against the plain pass (transformers internals).
        reusable = reuse.enabled and supports_prompt_cache(model) and reuse_works(model.get_decoder(), self._padded_pass)
        self._prefix = TorchPrefix(reuse) if reusable else None
        max_len = int(self._max_model_len or getattr(config, "max_position_embeddings", 4096))
        self._forms = HiddenForms.start(self.spec.inference, model.get_output_embeddings().weight, path.name)
        self._info = EngineInfo(
            engine="torch",
            model=path.name,
            fingerprint=model_fingerprint(path),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            hidden_size=int(model.get_output_embeddings().weight.shape[1]),
            max_model_len=max_len,
            max_topk=self.spec.max_topk,
            temperature=True,
            dtype=str(dtype).removeprefix("torch."),
            outputs=(*EngineInfo.outputs, "score_ids"),
            score_ids_method="log_softmax",
            media=self._media.kinds if self._media is not None else (),
            batch_invariant=self._invariant,
            **self._forms.info_fields(),
        )
        log.info("torch engine loaded %s on %s (%s)", path, device, dtype)

    async def close(self) -> None:
        self._model = None

    @property
    def module(self) -> torch.nn.Module:
        """The loaded model (weight swapping copies state dicts in and out of it)."""
        if self._model is None:
            raise EngineError("engine not started")
        if self._prefix is not None:  # whoever takes the module may change its weights
            self._prefix.clear()
        return self._model

    # -- protocol --------------------------------------------------------------------------
    def describe(self) -> EngineInfo:
        return started_info(self._info)

    def token_budget(self) -> int:
        return self._budget

    async def check_health(self) -> bool:
        """The device still computes: a two-token forward through the model (a CUDA error is
        sticky, so a device that failed once fails this too). While a batch runs the lock is
        held and the batch is the proof of life: the probe never waits behind it."""
        if self._model is None:
            return False
        return await asyncio.to_thread(self._probe)

    def _probe(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return True
        try:
            model = self._model
            if model is None:
                return False
            device = next(model.parameters()).device
            with torch.inference_mode():
                states = model.get_decoder()(input_ids=torch.tensor([[1, 2]], device=device)).last_hidden_state
            return bool(torch.isfinite(states).all())
        except Exception:
            log.exception("the torch engine's health probe failed")
            return False
        finally:
            self._lock.release()

    def unembedding(self) -> torch.Tensor:
        if self._model is None:
            raise EngineError("engine not started")
        return self._model.get_output_embeddings().weight.detach().to("cpu")

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [self._request_problem(r) for r in batch]
        prepared: dict[str, PreparedMedia] = {}
        if self._media is not None and any(r.media for r in batch):  # processor + placeholder check
            await asyncio.to_thread(self._prepare_media, batch, outcomes, prepared)
        scorable = [r for r, problem in zip(batch, outcomes, strict=True) if problem is None]
        if scorable:
            results = iter(await asyncio.to_thread(self._score_sync, scorable, prepared))
            outcomes = [next(results) if problem is None else problem for problem in outcomes]
        return outcomes  # type: ignore[return-value]

    def _request_problem(self, request: EngineRequest) -> RequestRejected | None:
        problem = request_problem(self.describe(), request)  # the front's rule (`teacher_serves`)
        if problem is None and not request.media and self._media is not None:  # a placeholder with its item lost
            problem = check_counts(request, self._media.placeholders)
        return problem

    def _prepare_media(self, batch: list[EngineRequest], outcomes: list[Outcome | None],
                       prepared: dict[str, PreparedMedia]) -> None:
        assert self._media is not None
        for index, request in enumerate(batch):
            if request.media and outcomes[index] is None:
                answer = self._media.prepare(request)
                if isinstance(answer, RequestRejected):
                    outcomes[index] = answer
                else:
                    prepared[request.key] = answer

    # -- the forward pass ------------------------------------------------------------------
    def _score_sync(self, batch: list[EngineRequest], prepared: dict[str, PreparedMedia] | None = None) -> list[Outcome]:
        model = self._model
        if model is None:
            raise EngineError("engine not started")
        with self._lock, torch.inference_mode():
            # Requests with media run the full model one by one (torch.media); text ones below.
            states: list = [TorchMedia.states(model, r, prepared[r.key]) if prepared and r.key in prepared else None
                            for r in batch]
            views = list(batch)  # each request as the forward computes it (a follower's rows start later)
            text = [i for i, rows in enumerate(states) if rows is None]
            reuse = self._text_states([batch[i] for i in text]) if text else None
            if reuse is not None:
                for slot, i in enumerate(text):
                    states[i], views[i] = reuse.states[slot], reuse.views[slot]
            results = [EngineResult(first_row=v.first_row, computed_tokens=v.num_tokens) for v in views]
            # A media request the model itself could not place is that request's error alone.
            kept = [i for i, rows in enumerate(states) if not isinstance(rows, RequestRejected)]
            for i in kept:
                if views[i].hidden_states:
                    results[i].hidden_states = self._forms.compress(states[i], views[i].hidden_form).to("cpu", copy=True)
            head = invariant.per_request(self._head_outputs) if self._invariant else self._head_outputs
            head(model, [views[i] for i in kept], [states[i] for i in kept], [results[i] for i in kept])
            if reuse is not None and self._prefix is not None:
                for i, result in zip(text, self._prefix.finish(reuse, [results[i] for i in text]), strict=True):
                    results[i] = result
            return [states[i] if isinstance(states[i], RequestRejected) else results[i] for i in range(len(batch))]

    def _text_states(self, batch: list[EngineRequest]) -> PrefixPass:
        """Rows of hidden states for text-only requests: one padded pass of the decoder body,
        shared prefixes from their kept KV (torch.prefix) when prompt reuse is on."""
        body = self._model.get_decoder()
        if self._invariant:  # batch-invariant: one unpadded pass per sequence (torch/invariant.py)
            self.forward_passes += len(batch)
            return PrefixPass(ReusePlan(), batch, invariant.sequence_states(body, batch), list(batch))
        if self._prefix is None:
            return PrefixPass(ReusePlan(), batch, self._padded_pass(body, batch, False)[0], list(batch))
        return self._prefix.states(body, batch, self._padded_pass)

    def _padded_pass(self, body, batch: list[EngineRequest], keep_cache: bool) -> tuple[list[torch.Tensor], object]:
        """One right-padded pass of the decoder body: each request's rows first_row..T-1 of
        hidden states, and the pass's KV cache when `keep_cache` (else None)."""
        device = next(body.parameters()).device
        width = max(r.num_tokens for r in batch)
        ids = np.zeros((len(batch), width), dtype=np.int64)  # torch's index form, filled from the int32 ids
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            ids[row, : request.num_tokens] = request.token_ids
            mask[row, : request.num_tokens] = 1
        self.forward_passes += 1
        kept = {"use_cache": True, "past_key_values": batch_cache()} if keep_cache else {"use_cache": False}
        out = body(input_ids=torch.from_numpy(ids).to(device), attention_mask=mask.to(device), **kept)
        hidden = out.last_hidden_state
        # Position i-1 produces row i: each request's rows first_row..T-1.
        states = [hidden[i, r.first_row - 1 : r.num_tokens - 1] for i, r in enumerate(batch)]
        return states, (out.past_key_values if keep_cache else None)

    def _head_outputs(self, model, batch: list[EngineRequest], states: list[torch.Tensor],
                      results: list[EngineResult]) -> None:
        """Log-probs, ranks, top-k and score_ids for every request of the batch from one lm_head
        pass over all their rows (in row chunks, `row_scores`): a few large kernels instead of a few
        small ones per request. The logits are the model's own: its head (and bias) and its final
        transforms (`logit_transforms`); score_ids are read from the same full log-softmax."""
        wanted = [i for i, r in enumerate(batch) if r.logprobs or r.topk or r.score_ids is not None]
        if not wanted:
            return
        rows = torch.cat([states[i] for i in wanted])
        targets = torch.from_numpy(np.concatenate([batch[i].token_ids[batch[i].first_row :] for i in wanted],
                                                  dtype=np.int64)).to(rows.device)
        score_ids = _padded_score_ids([batch[i] for i in wanted])
        head, transforms = model.get_output_embeddings(), self._transforms
        scores = score_rows(lambda h: transforms.apply(head(h)), rows, targets,
                            topk=max(batch[i].topk for i in wanted),
                            temperatures=_row_temperatures([batch[i] for i in wanted], rows.device),
                            score_ids=None if score_ids is None else score_ids.to(rows.device), ranks=any(batch[i].ranks for i in wanted))
        sizes = [states[i].shape[0] for i in wanted]

        def split(tensor: torch.Tensor | None) -> list:
            return list(tensor.cpu().split(sizes)) if tensor is not None else [None] * len(wanted)

        parts = zip(wanted, split(scores.logprobs), split(scores.ranks), split(scores.topk_logprobs),
                    split(scores.topk_ids), split(scores.score_logprobs), strict=True)
        for index, lp, ranks, top_values, top_ids, at_ids in parts:
            request, result = batch[index], results[index]
            if request.logprobs:
                result.logprobs = lp.clone()
                result.ranks = ranks.to(torch.int64) if request.ranks else None
            if request.topk:
                result.topk_logprobs = top_values[:, : request.topk].contiguous()
                result.topk_ids = top_ids[:, : request.topk].contiguous()
            if request.score_ids is not None:
                result.score_logprobs = at_ids[:, : request.score_ids.shape[1]].contiguous()


def check_own_logits(model, transforms: LogitTransforms) -> None:
    """Refuse a text model whose own forward's logits this engine's head path does not reproduce
    (a final transform it does not know): one short forward at start, both ways."""
    device = next(model.parameters()).device
    ids = torch.arange(1, 9, device=device).remainder(model.get_output_embeddings().weight.shape[0])[None]
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        ours = transforms.apply(model.get_output_embeddings()(hidden)).float()
        theirs = model(input_ids=ids, use_cache=False).logits.float()
    tolerance = 1e-3 * max(1.0, float(theirs.abs().max()))
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=0, atol=tolerance):
        gap = float((ours - theirs).abs().max()) if ours.shape == theirs.shape else float("inf")
        raise EngineConfigError(
            f"the teacher's logits are not its lm_head's output with {transforms.describe()} (the known final "
            f"transforms; max difference {gap:.3g}): {type(model).__name__} transforms its logits in a way the "
            "torch engine cannot reproduce; serve it with inference.name=vllm"
        )


def _padded_score_ids(batch: list[EngineRequest]) -> torch.Tensor | None:
    """The batch's score_ids rows stacked in row order, padded with -1 to the widest K (a request
    without score_ids gets all -1 rows), so that one gather per row chunk serves every request."""
    widths = [r.score_ids.shape[1] for r in batch if r.score_ids is not None]
    if not widths:
        return None
    out = np.full((sum(r.num_rows for r in batch), max(widths)), -1, dtype=np.int64)
    row = 0
    for request in batch:
        if request.score_ids is not None:
            out[row : row + request.num_rows, : request.score_ids.shape[1]] = request.score_ids
        row += request.num_rows
    return torch.from_numpy(out)
