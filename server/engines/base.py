"""The engine protocol: what every teacher engine (torch, vLLM, vLLM-Omni) offers the service.

An engine scores a *batch* of requests at once. The service hands it whatever it has
batched; an engine with its own scheduler (vLLM) fans the batch out, the torch engine pads
it into one forward pass. A batch is a list, not one request at a time, so that an engine can
spot requests that share a prefix (the n responses of one GRPO group: equal leading token ids,
found by the engine, no prompt length needed) and prefill it once (`proctor.server.engines.prompt_reuse`;
the torch engine keeps the KV cache, the vLLM engine reads vLLM's prefix cache where that is
safe). Results follow the row convention of the wire contract: row i is about token i given tokens
0..i-1, rows `first_row..T-1` are returned.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from proctor.server.engines.token_ids import token_array

# Tokens an engine takes in one batch unless its settings say otherwise (vLLM's GPU default).
DEFAULT_TOKEN_BUDGET = 8192
ENGINE_NAMES = ("torch", "vllm", "vllm_omni")
# Engines that spawn processes of their own, which must inherit the replica's environment:
# always in a worker, whatever `inference.replica_worker` says.
SPAWNING_ENGINES = ("vllm", "vllm_omni")


class EngineConfigError(ValueError):
    """A teacher's engine settings cannot work; the message says what to change."""


@dataclass(frozen=True)
class MediaItem:
    """One encoded media item as the rollout sent it (bytes plus its media type)."""

    data: bytes
    media_type: str


@dataclass(frozen=True)
class MultiModalInputs:
    """Media attached to a sequence; engines that take none refuse a non-empty one.

    `decoded` is filled by the service before admission (`media.decode_media`, off the event loop,
    bounded) in vLLM's `multi_modal_data` form, so no engine decodes bytes itself.
    """

    images: tuple[MediaItem, ...] = ()
    videos: tuple[MediaItem, ...] = ()
    audios: tuple[MediaItem, ...] = ()
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    decoded: dict[str, list[Any]] | None = field(default=None, compare=False, repr=False)

    def __bool__(self) -> bool:
        return bool(self.images or self.videos or self.audios)

    def kinds(self) -> list[str]:
        return [name for name in ("images", "videos", "audios") if getattr(self, name)]


# Request keys: this process's random prefix and a count (a uuid4 per request costs more).
_KEY_PREFIX = uuid.uuid4().hex[:16]
_KEYS = itertools.count()


# Ids, in one form from the wire to the engine: `token_ids` and `score_ids` are C-contiguous numpy
# int32 arrays (`engines.token_ids`). int32, because the wire's ids are int32 (ScoreRequest.token_ids,
# score_ids' INT32 tensor), every vocabulary fits, and nothing before an engine's own library needs
# wider. numpy, because validation reads them with numpy off any torch thread, a worker's socket
# carries a numpy array out of band (pickle 5: no copy to send it, a view of the frame received),
# and prompt reuse hashes its bytes as they are. Made once (validation: a copy of the repeated
# field; score_ids a view of the message's bytes, read-only) and never converted on the way; each
# engine converts at its library's boundary only: torch indexes with int64 (`index_tensor`, or a
# padded int64 batch), vLLM takes a list.
# A request carries three ids, each for its own reader: `request_id` is the caller's (echoed in
# the answer, in logs; it may repeat), `key` is unique per validated request in this server (what
# `abort`, the batcher and a replica's strikes name), and vLLM's own request id is made per attempt
# (`vllm.args.engine_request_id`), since a retry of one request may reach the same engine.
@dataclass(frozen=True)
class EngineRequest:
    """One validated sequence to score."""

    request_id: str
    token_ids: np.ndarray  # int32 [T]
    first_row: int  # 1 <= first_row < T
    logprobs: bool
    topk: int
    hidden_states: bool
    media: MultiModalInputs | None = None
    # Token ids to score per row (rows first_row..T-1), int32 [R, K], -1 for padding: the
    # student's top-k, say, which the teacher's own top-k misses.
    score_ids: np.ndarray | None = None
    key: str = field(default_factory=lambda: f"{_KEY_PREFIX}-{next(_KEYS)}")
    # Divides the logits before the log-softmax (log-probs and top-k; hidden states unchanged).
    temperature: float = 1.0
    cache_salt: str = ""  # scopes prompt reuse (`ScoreRequest.cache_salt`): salts never share prefixes
    hidden_form: str = ""  # the hidden states' wire form (`engines.hidden_forms`); "": the engine's dtype
    ranks: bool = False  # the actual tokens' ranks too: only /v1/completions answers them (a pass over V)

    def __post_init__(self) -> None:  # ids in the one form: a no-op (same arrays) for validated ones
        object.__setattr__(self, "token_ids", token_array(self.token_ids))
        if self.score_ids is not None:
            object.__setattr__(self, "score_ids", token_array(self.score_ids))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return self.num_tokens - self.first_row


@dataclass
class EngineResult:
    """Outputs for rows first_row..T-1 (only those that were asked for are set)."""

    first_row: int
    logprobs: torch.Tensor | None = None  # float32 [R]
    topk_ids: torch.Tensor | None = None  # int32 [R, K]
    topk_logprobs: torch.Tensor | None = None  # float32 [R, K]
    hidden_states: torch.Tensor | None = None  # [R, H], engine dtype, or the request's hidden_form
    # The actual token's rank in its row (1: the most likely), int64 [R], when the request asked it.
    ranks: torch.Tensor | None = None
    score_logprobs: torch.Tensor | None = None  # float32 [R, K], -inf at padded score_ids
    # Prefix tokens not recomputed, shared with an earlier request (0: computed whole; None: reuse
    # did not apply), and token positions the engine ran for it (its own count; None: not known).
    prompt_reused_tokens: int | None = None
    computed_tokens: int | None = None
    # Set by the batcher: time spent waiting for a batch, and the batch's engine time.
    queue_seconds: float = 0.0
    engine_seconds: float = 0.0
    # Set by the replica that scored it: the fingerprint of the weights it holds (a teacher moving
    # between checkpoints answers from either step, each answer whole from one).
    fingerprint: str = ""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine serves; the service validates requests against it."""

    engine: str
    model: str
    fingerprint: str
    vocab_size: int
    hidden_size: int
    max_model_len: int
    max_topk: int
    dtype: str
    outputs: tuple[str, ...] = ("logprobs", "topk", "hidden_states", "unembedding")
    media: tuple[str, ...] = ()
    # Whether the engine applies a request's temperature (T != 1 is refused where it does not).
    temperature: bool = False
    # Longest sequence the engine scores. vLLM needs one slot beyond the prompt for the output
    # token of its one-token prefill, so there it is max_model_len - 1; None: max_model_len.
    longest_sequence: int | None = None
    # How score_ids are scored ("" when "score_ids" is not among the outputs); see TeacherInfo.
    score_ids_method: str = ""
    batch_invariant: bool = False  # scores independent of batch, padding, replica (`engines/invariance`)
    hidden_forms: tuple[str, ...] = ()  # offered (`engines.hidden_forms`), and a projection's rank r
    projection_rank: int = 0
    projection_energy: float | None = None  # and the share of the unembedding's energy it keeps

    @property
    def max_sequence_tokens(self) -> int:
        return self.max_model_len if self.longest_sequence is None else self.longest_sequence


# --------------------------------------------------------------------------------------------
# The error taxonomy: a request's fault or the replica's
# --------------------------------------------------------------------------------------------


class EngineError(RuntimeError):
    """A *replica* error: the replica itself is unwell (its process died, its engine says it is
    dead, it stopped answering). The replica is marked failed and restarted; the request is
    retried on another replica (once: `front.fleet.replica_faults`). An engine that merely raised
    on a batch is not this (`BatchFailed`)."""


class RequestRejected(Exception):
    """A *request* error found inside an engine: this one request cannot be scored (media the
    processor rejects, too long for the engine, placeholders that do not match the media).

    It becomes INVALID_ARGUMENT / 422 naming `field` for that request only; it never marks the
    replica, and the other requests of the batch are scored as usual. Engines return it in
    place of that request's `EngineResult` (see `TeacherEngine.score`).
    """

    def __init__(self, field: str, message: str, *, request_id: str = "") -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"
        self.reason = message
        self.request_id = request_id

    def __reduce__(self):  # crosses the engine-host socket intact
        return (_rebuild_rejected, (self.field, self.reason, self.request_id))


def _rebuild_rejected(field: str, message: str, request_id: str) -> RequestRejected:
    return RequestRejected(field, message, request_id=request_id)


class RequestAborted(Exception):
    """The request was aborted inside the engine (its caller cancelled or its deadline passed)."""


class RequestFailed(Exception):
    """A *server-side* fault that hit this one request: the engine raised on it alone (its
    forward, a processor, proctor's own code), its process alive and its batch-mates answered.

    It becomes INTERNAL naming `cause` unless another replica answers the request (routing
    retries it once there, `front.fleet.replica_faults`); it takes the replica out of rotation only
    when the replica is found unwell (its health probe fails, or requests that other replicas
    answer keep failing on it), never for one request.
    """

    def __init__(self, cause: str, *, out_of_memory: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.out_of_memory = out_of_memory

    def __reduce__(self):  # crosses the engine-host socket intact
        return (_rebuild_failed, (self.cause, self.out_of_memory))


def _rebuild_failed(cause: str, out_of_memory: bool) -> RequestFailed:
    return RequestFailed(cause, out_of_memory=out_of_memory)


class BatchFailed(Exception):
    """The engine raised while scoring a whole batch, its process alive: which request is at
    fault (or whether the batch was merely too large: `out_of_memory`) is not known until the
    batch is split (`front.fleet.batch_isolation`). An engine host reports an exception of its
    engine's batch as this; any exception but `EngineError` an engine raises counts as one."""

    def __init__(self, cause: str, *, out_of_memory: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.out_of_memory = out_of_memory


# What an engine answers for one request of a batch: its result, a request error, an abort,
# a server-side fault of this request alone, or (a replica error that hit this request only,
# e.g. the engine died before it finished while others of the batch had finished) an EngineError.
Outcome = Union["EngineResult", RequestRejected, RequestAborted, RequestFailed, EngineError]


def started_info(info: EngineInfo | None, who: str = "engine") -> EngineInfo:
    """An engine's `describe()`: its EngineInfo once started; before that an EngineError."""
    if info is None:
        raise EngineError(f"{who} not started")
    return info


class TeacherEngine(abc.ABC):
    """A loaded teacher model that scores batches of sequences."""

    @abc.abstractmethod
    def describe(self) -> EngineInfo:
        """Static facts about the loaded teacher."""

    @abc.abstractmethod
    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        """Score every request of the batch; one outcome per request, in the same order.

        An outcome is the request's `EngineResult`, a `RequestRejected` (that request's input
        is at fault), a `RequestAborted` (aborted through `abort`), a `RequestFailed` (a
        server-side fault of this request alone) or an `EngineError` (the replica failed
        before this request finished; requests that did finish keep their results, so nothing
        is computed twice). Raising `EngineError` says the replica failed; raising anything
        else says the batch failed, and the batcher splits it to find the request at fault
        (`front.fleet.batch_isolation`).
        """

    async def abort(self, request_keys: list[str]) -> None:  # noqa: B027  (optional hook)
        """Stop computing these requests (`EngineRequest.key`: their callers gave up); their outcomes become
        `RequestAborted`. Engines that cannot stop a running batch (the torch engine's one
        padded forward pass) do nothing: a request cancelled before its batch starts is
        never computed anyway (the batcher drops it)."""

    @abc.abstractmethod
    def unembedding(self) -> torch.Tensor:
        """The teacher's output embedding [V, H] (for full-vocabulary losses): the model's own
        (`get_output_embeddings()`), whatever its architecture calls it."""

    async def fetch_unembedding(self) -> torch.Tensor:
        """`unembedding()` without blocking the caller's event loop: in a thread here (it may
        read the checkpoint); from the worker where the weights live (replica workers, actors)."""
        return await asyncio.to_thread(self.unembedding)

    def token_budget(self) -> int:
        """Most tokens the engine wants in one batch (the service's batcher respects it)."""
        return DEFAULT_TOKEN_BUDGET

    def extra_load(self) -> int:
        """Tokens of work beyond the replica's own requests (a shared group's other teachers): routing adds them."""
        return 0

    async def start(self) -> None:  # noqa: B027  (optional hook)
        """Load weights / start background workers (called once before serving)."""

    async def close(self) -> None:  # noqa: B027  (optional hook)
        """Release devices and background workers."""

    async def check_health(self) -> bool:
        """Cheap liveness check used by the pool; engines with a sub-process override it."""
        return True


def serving_dtype(requested: str | None, checkpoint: Any) -> str:
    """The dtype a teacher is served in: as requested, and for "auto" the checkpoint's own
    (float32 when it names none) on every engine, so engines agree on the same model."""
    if requested and requested != "auto":
        return requested
    return str(checkpoint).removeprefix("torch.") if checkpoint else "float32"


@dataclass(frozen=True)
class EngineSpec:
    """How to build one replica of a teacher engine (from config or the CLI).

    `inference` holds verl's `teacher_models.<name>.inference` settings as given
    (tensor_model_parallel_size, max_model_len, max_num_batched_tokens, engine_kwargs, ...);
    each engine reads what applies to it and validates it at startup.
    """

    name: str  # "torch" | "vllm" | "vllm_omni"
    model_path: str
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N" | "npu" | "npu:N"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    max_topk: int = 64
    inference: dict[str, Any] = field(default_factory=dict)
    # Devices the replica may use (ids as strings); its engine processes get *_VISIBLE_DEVICES
    # from them through their own environment (`engine_environment`), never `os.environ`.
    devices: tuple[str, ...] = ()
    # Whether the teacher serves hidden states, decided once by the serving plan.
    hidden_states: bool = True
    # Seconds a replica may take to start before it fails with its engine's log tail.
    startup_timeout_s: float = 1800.0
    # A Ray placement group reserved for a replica that spans nodes (vLLM's Ray executor runs on it).
    placement_group: Any = field(default=None, compare=False)
