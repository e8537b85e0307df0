"""The replica skeleton the vLLM and vLLM-Omni engines share: start / fan-out / abort / close,
describe and unembedding. The pure parts live beside it: settings → engine arguments
(`vllm_args`), the checkpoint's facts and unembedding (`checkpoint`), prompt log-probs → rows
(`prompt_logprobs`) and request errors vs replica errors (`vllm_errors`).

Devices: these engines never set `*_VISIBLE_DEVICES` themselves; the process that hosts them
(`worker.main`, or a Ray actor) is started with the replica's environment.

Nothing here imports vLLM at module level, so the pure parts are tested without an engine.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
from pathlib import Path

import torch

from proctor.proto import torch_dtype
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
    started_info,
)
from proctor.server.engines.checkpoint import (
    checkpoint_text_config,
    fingerprint,
    load_unembedding,
    model_facts,
)
from proctor.server.engines.hidden_forms import HiddenForms
from proctor.server.engines.invariance import batch_invariant
from proctor.server.engines.logit_transforms import logit_transforms
from proctor.server.engines.multimodal import check_counts
from proctor.server.engines.score_ids import FROM_HIDDEN
from proctor.server.engines.teacher_serves import request_problem
from proctor.server.engines.vllm.args import resolve_max_logprobs
from proctor.server.engines.vllm.errors import classify_error

log = logging.getLogger(__name__)


# How long the EngineCore may take to answer a health probe (a utility call that it answers
# between two steps): a stopped or wedged core fails the health check within this bound.
PROBE_TIMEOUT_S = 10.0
# How many aborted request keys a replica remembers.
ABORTED_KEPT = 1024


class VllmFamilyEngine(TeacherEngine):
    """Start/close, describe, unembedding, batch fan-out and abort shared by the vLLM engines.

    Subclasses build their engine clients in `_start_engines` and score one request in
    `_score_one`; the requests of a batch run concurrently as tasks (vLLM batches them), so
    each has its own outcome and `abort` cancels just its task, which aborts it in vLLM
    (AsyncLLM.generate aborts a request whose consumer is cancelled).
    """

    engine_name = "vllm"
    sub_config: tuple[str, ...] = ()
    # A text or VL checkpoint's names, then an Omni checkpoint's (its Thinker's weights).
    head_names: tuple[str, ...] = ("lm_head.weight", "thinker.lm_head.weight")
    embed_names: tuple[str, ...] = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                                    "thinker.model.embed_tokens.weight")
    media_kinds: tuple[str, ...] = ()
    temperature = False  # whether a request's temperature applies (else T != 1 is refused)

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.settings = dict(spec.inference or {})
        self.max_logprobs = resolve_max_logprobs(spec, self.engine_name)
        self._info: EngineInfo | None = None
        self.score_ids_method = ""  # decided at start (`_choose_score_ids_method`)
        self._unembedding: torch.Tensor | None = None
        self.forms = HiddenForms()  # the hidden-state forms, set at start (`engines.hidden_forms`)
        self._started = False
        self._closed = False
        self._running: dict[str, asyncio.Task] = {}
        # Keys of the latest requests aborted while computing (evidence for tests), bounded: a
        # long-running replica must not keep every key it ever aborted.
        self.aborted: collections.deque[str] = collections.deque(maxlen=ABORTED_KEPT)

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
        self.score_ids_method = self._choose_score_ids_method()
        if self.serves_hidden_states:
            self.forms = await asyncio.to_thread(HiddenForms.start, self.settings, self.unembedding, self.spec.model_path)
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
            longest_sequence=self._max_sequence(max_len),
            temperature=self.temperature,
            score_ids_method=self.score_ids_method,
            batch_invariant=batch_invariant(self.settings),  # vLLM's own mode (`invariance`)
            **(self.forms.info_fields() if self.serves_hidden_states else {}),
        )

    def _max_sequence(self, max_model_len: int) -> int:
        """The longest sequence scored: a generating prefill's one output token needs a slot."""
        return max_model_len - 1

    def _outputs(self) -> tuple[str, ...]:
        base = ("logprobs", "topk", "unembedding")
        base = (*base, "hidden_states") if self.serves_hidden_states else base
        return (*base, "score_ids") if self.score_ids_method else base

    def _choose_score_ids_method(self) -> str:
        """How this replica scores score_ids ("" for not at all): from its hidden states and the
        checkpoint's lm_head (`score_ids.scores_from_hidden`), which holds only where the logits
        are h·Wᵀ; a model that soft-caps or scales them serves no score_ids here."""
        if not self.serves_hidden_states:
            return ""
        transforms = logit_transforms(checkpoint_text_config(self.spec.model_path, self.sub_config))
        if not transforms.identity:
            log.warning("%s: no score_ids: the teacher's logits have %s, which the hidden-state method "
                        "cannot reproduce", self.spec.model_path, transforms.describe())
            return ""
        return FROM_HIDDEN

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
        return started_info(self._info, f"{self.engine_name} engine")

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
            log.warning("%s engine is unwell (request %s): %s", self.engine_name, request.request_id, outcome)
        return outcome

    async def abort(self, request_keys: list[str]) -> None:
        for key in request_keys:
            task = self._running.get(key)
            if task is not None and not task.done():
                task.cancel()
                self.aborted.append(key)

    def _request_problem(self, request: EngineRequest) -> RequestRejected | None:
        """What this engine cannot score about a request (the front checked it by the same rule,
        `teacher_serves`, unless the request came another way), and a placeholder whose item is lost."""
        problem = request_problem(self.describe(), request)
        if problem is None and not request.media and self.media_kinds:
            problem = check_counts(request, self._media.placeholders)
        return problem
