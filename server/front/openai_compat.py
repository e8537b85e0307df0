"""The scoring subset of vLLM's OpenAI-compatible server, on proctor's HTTP port.

(Its length, a little over 400 lines, is the three endpoints' request checks and vLLM's answer
shape, which belong together: one module is the whole compatibility contract.)

Trainers pick a teacher service by what they already speak: TRL's `VLLMClient` (its
`get_sequence_logprobs`, behind the server-distillation trainers), the `openai` package and
hand-written clients of `vllm serve` score token sequences with `GET /health`, `GET /v1/models`
and `POST /v1/completions` carrying token-id prompts, `max_tokens: 1` and `prompt_logprobs: K`.
Answering those three here lets them use a proctor teacher unchanged, `model` being the teacher
key, and every request goes through the same `ScoringService.score` as `/v1/score` (routing,
validation, admission, metrics, auth by the app's middleware).

Only what scoring means is served, each field exactly as vLLM answers it:
`choices[i].prompt_logprobs` is `null` at position 0, then per position a dict
`{"<token id>": {"logprob", "rank", "decoded_token"}}` with the top-K (ranks 1..K) and the actual
token at its true rank (the engine's), `choices[i].prompt_token_ids`, `usage`. `temperature`
divides the teacher's logits before the log-softmax (the service refuses T != 1 on an engine
that cannot). Nothing is generated: `text` is "" (the decoded prompt with `echo`), no completion
tokens. Anything else of the completions API (sampling controls, `max_tokens` > 1, streaming,
`n` > 1, completion `logprobs`, text prompts for a teacher without a tokenizer) is refused with
a 400 naming the parameter, never half-served. Errors take OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.

Bodies follow the HTTP shell's rules: read with its size limit, decoded with the bounded JSON
parser, and large bodies and large answers are decoded and encoded off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from proctor.proto import scoring_pb2
from proctor.proto.wire import RETRY_AFTER_HEADER
from proctor.server.errors import Code, ScoringError, invalid
from proctor.server.front.bounded_json import loads_bounded
from proctor.server.front.completion_json import TokenText, prompt_logprobs_json
from proctor.server.front.responses import Responses
from proctor.server.front.routing import ReplicaSet
from proctor.server.front.service import ScoringService

log = logging.getLogger(__name__)

# Answers with more (position, candidate) cells than this are built and encoded in a worker
# thread, as the HTTP shell decodes large bodies there: the event loop (gRPC too) keeps serving.
_INLINE_ANSWER_CELLS = 20_000
_INLINE_BODY_BYTES = 256 << 10
# Token ids go into a ScoreRequest in slices of this many (as /v1/score's JSON path does).
_IDS_SLICE = 1 << 16
_INT32 = range(-(2**31), 2**31)

# Completions parameters that mean nothing to scoring, accepted at their neutral value only
# (what the `openai` package or vLLM would default them to); any other value is refused.
_NEUTRAL = {
    "n": (1,),
    "best_of": (1,),
    "stream": (False,),
    "stream_options": (),
    "logprobs": (),
    "top_p": (1, 1.0),
    "top_k": (0, -1),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "stop": ((), []),
    "stop_token_ids": ((), []),
    "logit_bias": ({},),
    "suffix": ("",),
    "min_tokens": (0,),
}
# Accepted whatever their value: they change nothing about a prompt's scores.
_IGNORED = frozenset({"user", "seed", "add_special_tokens", "skip_special_tokens", "request_id",
                      "return_tokens_as_token_ids", "spaces_between_special_tokens"})
_SERVED = frozenset({"model", "prompt", "max_tokens", "temperature", "prompt_logprobs", "echo"})

# OpenAI's error `type` per contract status (the HTTP status comes from the status table,
# except bad input: 400 here, as vLLM and OpenAI answer it, where /v1/score says 422).
_ERROR_TYPES = {
    "INVALID_ARGUMENT": "invalid_request_error",
    "NOT_FOUND": "not_found_error",
    "PAYLOAD_TOO_LARGE": "invalid_request_error",
    "UNAUTHENTICATED": "authentication_error",
    "RESOURCE_EXHAUSTED": "rate_limit_error",
    "UNAVAILABLE": "service_unavailable_error",
    "DEADLINE_EXCEEDED": "timeout_error",
    "CANCELLED": "cancelled_error",
}

# One scored prompt as the service answers it (its `result`, `teacher`, `mode`); left untyped so
# this module does not depend on the service's name for it.
Scored = Any
# The app's call scoring a body's prompts together: their answers in order, None if the client left.
ScoreAll = Callable[..., Awaitable[list[Scored] | None]]
T = TypeVar("T")


def openai_error(error: ScoringError) -> JSONResponse:
    """A ScoringError in OpenAI's error shape, with the status a vLLM server would give."""
    status = 400 if error.code is Code.INVALID_ARGUMENT else error.code.http_status
    body = {"error": {"message": error.message, "type": _ERROR_TYPES.get(error.code.name, "internal_server_error"),
                      "param": error.field, "code": status}}
    headers = {RETRY_AFTER_HEADER: str(max(1, round(error.retry_after)))} if error.retry_after is not None else {}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(frozen=True)
class CompletionAsk:
    """A `/v1/completions` body reduced to what scoring needs (every other field checked away)."""

    model: str
    prompts: list[list[int] | str]
    topk: int
    echo: bool
    temperature: float | None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(prompt: list, field: str) -> list[int]:
    if not prompt:
        raise invalid(field, "is empty")
    if not all(_is_int(t) and t in _INT32 for t in prompt):
        raise invalid(field, "must be token ids: integers in the int32 range")
    return prompt


def _prompts(prompt: Any) -> list[list[int] | str]:
    """vLLM's prompt forms: one id list, a list of id lists, a string, or a list of strings."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", "must be token ids, a list of token-id lists, or text")
    if all(_is_int(t) for t in prompt):
        return [_ids(prompt, "prompt")]
    out: list[list[int] | str] = []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            out.append(_ids(item, f"prompt[{index}]"))
        else:
            raise invalid(f"prompt[{index}]", "must be a list of token ids or a string")
    return out


def _check_unserved(body: dict) -> None:
    for key, value in body.items():
        if key in _SERVED or key in _IGNORED:
            continue
        if key not in _NEUTRAL:
            raise invalid(key, "is not supported: this server scores prompts (prompt_logprobs) and generates nothing")
        if value is not None and value not in _NEUTRAL[key]:
            raise invalid(key, f"is {value!r}; only its neutral value is served here (scoring: "
                          "prompt_logprobs with max_tokens 1, or 0 with echo)")


def parse_completion(body: Any) -> CompletionAsk:
    """Check a completions body field by field; anything that is not scoring is a 400 naming it."""
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    _check_unserved(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string (a teacher key from /v1/models)")
    if "prompt" not in body:
        raise invalid("prompt", "is required")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise invalid("echo", "must be a boolean")
    max_tokens = body.get("max_tokens")
    if not _is_int(max_tokens) or max_tokens not in ((0, 1) if echo else (1,)):
        raise invalid("max_tokens", f"is {max_tokens!r}; this server scores prompts and generates nothing: "
                      "send max_tokens 1 (or 0 with echo)")
    topk = body.get("prompt_logprobs")
    if topk is None:
        raise invalid("prompt_logprobs", "is required: this server answers prompt log-probs only")
    if not _is_int(topk) or topk < 0:
        raise invalid("prompt_logprobs", f"is {topk!r}; it must be an integer >= 0")
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise invalid("temperature", "must be a number")
        if not math.isfinite(float(temperature)) or temperature <= 0:
            raise invalid("temperature", f"is {temperature}; it must be a finite number > 0 (it divides the "
                          "teacher's logits before the log-softmax)")
    return CompletionAsk(model or "", _prompts(body["prompt"]), topk, echo,
                         None if temperature is None else float(temperature))


class Tokenizers:
    """Each teacher's tokenizer, loaded once from its model directory in this (front) process,
    for `decoded_token` and text prompts. A teacher without one decodes to "" and refuses text."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def model_dir(teacher: ReplicaSet) -> Path | None:
        for replica in teacher.replicas:
            spec = getattr(replica.engine, "spec", None)
            if spec is not None and getattr(spec, "model_path", None):
                return Path(spec.model_path)
        return None

    def get(self, teacher: ReplicaSet) -> Any:
        """The teacher's tokenizer or None (blocking: call it off the event loop the first time)."""
        with self._lock:
            if teacher.name not in self._loaded:
                self._loaded[teacher.name] = self._load(self.model_dir(teacher))
            return self._loaded[teacher.name]

    def loaded(self, teacher: ReplicaSet) -> bool:
        return teacher.name in self._loaded

    @staticmethod
    def _load(path: Path | None) -> Any:
        if path is None or not path.is_dir():
            return None
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # no tokenizer files, or one transformers cannot read
            log.info("no tokenizer for %s (%s): decoded_token will be empty, text prompts refused", path, exc)
            return None


def token_text(tokenizer: Any) -> TokenText:
    """`decoded_token` for ids of this tokenizer (each id decoded alone; "" without a tokenizer)."""
    return TokenText(lambda token: tokenizer.decode([token]) if tokenizer is not None else "")


@dataclass(frozen=True)
class Built:
    """A completions request made ready for the service: its prompts as token ids and one
    `ScoreRequest` per prompt."""

    prompts: list[list[int]]
    messages: list[scoring_pb2.ScoreRequest]


def build_requests(ask: CompletionAsk, teacher_name: str, tokenizer: Any) -> Built:
    """Text prompts tokenized, and one ScoreRequest per prompt (ids in slices, so that no one C
    call holds the GIL long): the work that grows with the body, done off the loop for a
    large body (`OpenAICompat.complete`)."""
    prompts: list[list[int]] = []
    messages = []
    for index, prompt in enumerate(ask.prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise invalid("prompt", f"teacher {teacher_name!r} has no tokenizer here: send token ids, "
                              f"not text (prompt {index})")
            prompt = list(tokenizer.encode(prompt))
        message = scoring_pb2.ScoreRequest(teacher_key=ask.model, logprobs=True, topk=ask.topk)
        for start in range(0, len(prompt), _IDS_SLICE):
            message.token_ids.extend(prompt[start:start + _IDS_SLICE])
        if ask.temperature is not None:
            message.temperature = ask.temperature
        prompts.append(prompt)
        messages.append(message)
    return Built(prompts, messages)


def completion_body(ask: CompletionAsk, model: str, prompts: list[list[int]], scored: list[Scored],
                    tokenizer: Any, text: TokenText) -> bytes:
    """The whole `/v1/completions` answer, serialised, as vLLM shapes it; the prompt log-probs are
    written column-wise (`completion_json`), the rest by `json.dumps`. With `echo` each choice's
    `text` is its prompt decoded (here too, so that a large answer's decoding is off the loop)."""
    choices = []
    for index, (ids, score) in enumerate(zip(prompts, scored, strict=True)):
        echoed = tokenizer.decode(ids) if ask.echo and tokenizer is not None else ""
        head = {"index": index, "text": echoed, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        result = score.result
        rows = prompt_logprobs_json(
            np.asarray(ids, dtype=np.int64), result.logprobs.numpy(),
            None if result.ranks is None else result.ranks.numpy(),
            None if result.topk_ids is None else result.topk_ids.numpy(),
            None if result.topk_logprobs is None else result.topk_logprobs.numpy(), text)
        choices.append(f'{_dumps(head)[:-1]},"prompt_logprobs":{rows},"prompt_token_ids":{_dumps(ids)}}}')
    tokens = sum(len(ids) for ids in prompts)
    top = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    return f'{_dumps(top)[:-1]},"choices":[{",".join(choices)}],"usage":{_dumps(usage)}}}'.encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


async def off_loop_if(large: bool, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` in a worker thread when `large`, else here: a thread hop costs more than
    a small request's whole build, a large one would hold the event loop (gRPC's too)."""
    if large:
        return await asyncio.to_thread(work, *args)
    return work(*args)


def _parse(raw: bytes) -> CompletionAsk:
    return parse_completion(loads_bounded(raw, field="body"))


class OpenAICompat:
    """The three vLLM-compatible routes over one ScoringService."""

    def __init__(self, service: ScoringService, responses: Responses, *, max_body_bytes: int, score_all: ScoreAll,
                 read_body: Callable[[Request, int], Awaitable[bytes]]) -> None:
        self.service = service
        self.responses = responses
        self.max_body_bytes = max_body_bytes
        self.score_all = score_all
        self.read_body = read_body
        self.tokenizers = Tokenizers()
        # One table per teacher, kept across answers (bounded by its vocabulary).
        self._token_texts: dict[str, TokenText] = {}

    async def tokenizer(self, teacher: ReplicaSet) -> Any:
        if self.tokenizers.loaded(teacher):
            return self.tokenizers.get(teacher)
        return await asyncio.to_thread(self.tokenizers.get, teacher)

    def token_text(self, teacher: ReplicaSet, tokenizer: Any) -> TokenText:
        """The teacher's `decoded_token` table (made on its first answer)."""
        text = self._token_texts.get(teacher.name)
        if text is None:
            text = self._token_texts[teacher.name] = token_text(tokenizer)
        return text

    def models(self) -> dict:
        data = []
        for teacher in self.service.router.teachers.values():
            try:
                info = teacher.info
                root, max_len = info.model, info.max_model_len
            except ScoringError:  # still loading
                root, max_len = teacher.name, None
            data.append({"id": teacher.keys[0], "object": "model", "created": int(time.time()),
                         "owned_by": "proctor", "root": root, "parent": None, "max_model_len": max_len,
                         "permission": []})
        return {"object": "list", "data": data}

    def _route(self, ask: CompletionAsk) -> ReplicaSet:
        """The teacher `model` names; an unknown one is counted as /v1/score counts it."""
        try:
            return self.service.router.route(ask.model)
        except ScoringError as error:
            self.service.metrics.request_done("unknown", "logprobs+topk" if ask.topk else "logprobs",
                                              error.code.name.lower())
            raise

    async def complete(self, request: Request) -> Response:
        """Read, check, score and answer one completions call. What grows with the request runs
        in a worker thread once it is large: the body's parse (over `_INLINE_BODY_BYTES`), the
        tokenizing and the ScoreRequests (a large body or text prompts), and the answer's JSON
        (over `_INLINE_ANSWER_CELLS`, or echoed text to decode), so /health/live and every other
        call keep being answered while a 20 MB body or a 100 MB answer is worked on."""
        try:
            raw = await self.read_body(request, self.max_body_bytes)
            large = len(raw) > _INLINE_BODY_BYTES
            ask = await off_loop_if(large, _parse, raw)
            teacher = self._route(ask)
            tokenizer = await self.tokenizer(teacher)
            texts = any(isinstance(prompt, str) for prompt in ask.prompts)
            built = await off_loop_if(large or texts, build_requests, ask, teacher.name, tokenizer)
            scored = await self.score_all(request, built.messages, unary=True)
        except ScoringError as error:
            return openai_error(error)
        if scored is None:
            return Response(status_code=499)
        model = ask.model or teacher.keys[0]
        cells = sum(len(ids) * (ask.topk + 1) for ids in built.prompts)
        payload = await off_loop_if(cells > _INLINE_ANSWER_CELLS or (ask.echo and tokenizer is not None),
                                    completion_body, ask, model, built.prompts, scored, tokenizer,
                                    self.token_text(teacher, tokenizer))
        self.responses.metrics.response_sent(scored[0].teacher, scored[0].mode, len(payload))
        return Response(payload, media_type="application/json")


def mount_openai_compat(app: FastAPI, service: ScoringService, responses: Responses, *, max_body_bytes: int,
                        score_all: ScoreAll, read_body: Callable[[Request, int], Awaitable[bytes]]) -> OpenAICompat:
    """Add `/health`, `/v1/models` and `/v1/completions` (scoring only) to the HTTP app.

    `score_all(request, messages, unary=...)` is the app's scoring call for a body's prompts that
    withdraws them all (None) if the client goes away, so a disconnected completions call leaves
    the queue as /v1/score does."""
    compat = OpenAICompat(service, responses, max_body_bytes=max_body_bytes, score_all=score_all,
                          read_body=read_body)

    @app.get("/health", summary="vLLM's readiness probe: 200 when every teacher can score")
    async def health() -> Response:
        return Response(status_code=200 if service.ready() else 503)

    @app.get("/v1/models", summary="One entry per teacher, as vLLM lists its model (id: the teacher key)")
    async def models() -> dict:
        return compat.models()

    @app.post("/v1/completions", summary="vLLM-compatible scoring: token-id prompts, max_tokens 1, prompt_logprobs")
    async def completions(request: Request) -> Response:
        return await compat.complete(request)

    return compat
