"""vLLM's scoring surface served over the ScoringService: `/v1/models` and `/v1/completions`.

A completions call is read (the HTTP shell's body rules), checked (`CompletionBody`), routed by
the service (`ScoringService.route`: the service's routing rule and its count of an unknown
teacher), its text prompts tokenized with the teacher's tokenizer, and each prompt scored by
`ScoringService.score` like any `/v1/score` call; the answer is `Responses.completion`. Work that
grows with the call runs in a worker thread once it is large: the body's parse, the tokenizing
and the ScoreRequests, the answer's JSON, so /health/live and every other call keep being
answered while a 20 MB body or a 100 MB answer is worked on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proctor.proto import scoring_pb2
from proctor.server.common.errors import ScoringError, invalid
from proctor.server.common.off_loop import off_loop_if
from proctor.server.front.bounded_json import loads_bounded
from proctor.server.front.fleet.routing import ReplicaSet
from proctor.server.front.http.cancellation import ClientGone, cancel_on_disconnect, client_gone
from proctor.server.front.http.errors import named_by_surface, openai_error
from proctor.server.front.http.openai_compat import CompletionBody
from proctor.server.front.http.request import INLINE_BODY_BYTES, read_body, request_timeout
from proctor.server.front.http.teacher_paths import path_key, routing_key
from proctor.server.front.http.teacher_tokenizers import Tokenizers
from proctor.server.front.ids import extend_ids
from proctor.server.front.responses import Responses
from proctor.server.front.service import ScoredRequest, ScoringService, ServiceState

# The service's field names that vLLM's completions request calls otherwise.
_VLLM_NAMES = {"teacher_key": "model"}


@dataclass(frozen=True)
class Built:
    """A completions call made ready for the service: its prompts as token ids and one
    `ScoreRequest` per prompt."""

    prompts: list[list[int]]
    messages: list[scoring_pb2.ScoreRequest]


def _template(ask: CompletionBody, key: str) -> scoring_pb2.ScoreRequest:
    """What every prompt of the call asks for, without its ids (`key`: the teacher's, `routing_key`)."""
    message = scoring_pb2.ScoreRequest(teacher_key=key, logprobs=True, topk=ask.topk, cache_salt=ask.cache_salt or "")
    if ask.scoring_temperature is not None:
        message.temperature = ask.scoring_temperature
    return message


def build_requests(ask: CompletionBody, template: scoring_pb2.ScoreRequest, teacher_name: str, tokenizer: Any) -> Built:
    """Text prompts tokenized, and one ScoreRequest per prompt (its ids as `CompletionForm.scored_ids`
    says): the work that grows with the body, done off the loop for a large body."""
    prompts: list[list[int]] = []
    messages = []
    form = ask.form
    for index, prompt in enumerate(ask.prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise invalid("prompt", f"teacher {teacher_name!r} has no tokenizer here: send token ids, "
                              f"not text (prompt {index})")
            prompt = list(tokenizer.encode(prompt))
        message = scoring_pb2.ScoreRequest()
        message.CopyFrom(template)
        extend_ids(message.token_ids, form.scored_ids(prompt))
        prompts.append(prompt)
        messages.append(message)
    return Built(prompts, messages)


async def score_all(service: ScoringService, teacher_set: ReplicaSet, messages: list[scoring_pb2.ScoreRequest],
                    timeout: float | None, *, ranks: bool = True) -> list[ScoredRequest]:
    """Score a call's prompts at once on the teacher the call was routed to, answers in order.
    The first error fails the call and withdraws the rest; a cancelled call (its client gone)
    withdraws them all. `ranks`: each actual token's rank too (vLLM's prompt_logprobs name it)."""
    jobs = [asyncio.ensure_future(service.score_on(teacher_set, message, timeout=timeout, unary=True, ranks=ranks))
            for message in messages]
    try:
        return await asyncio.gather(*jobs)
    finally:
        await _withdraw(jobs)
        # A job's error raised here holds this frame, which holds the jobs: release them, or the
        # call's requests live until the cyclic collector runs (see `cancellation`).
        jobs.clear()


async def _withdraw(jobs: list[asyncio.Future]) -> None:
    """Cancel the jobs not yet done and wait for them (in a frame of its own, so that no job is
    left in the caller's)."""
    if not all(job.done() for job in jobs):
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)


@dataclass(frozen=True)
class _Scored:
    """A completions call scored: what its answer is made of."""

    ask: CompletionBody
    teacher_set: ReplicaSet
    tokenizer: Any
    prompts: list[list[int]]
    scored: list[ScoredRequest]


def _parse(raw: bytes, max_numbers: int | None) -> CompletionBody:
    return CompletionBody.check(loads_bounded(raw, field="body", max_numbers=max_numbers))


class CompletionsServing:
    """`/v1/models` and `/v1/completions` over one ScoringService."""

    def __init__(self, service: ScoringService, responses: Responses, *, max_body_bytes: int) -> None:
        self.service = service
        self.responses = responses
        self.max_body_bytes = max_body_bytes
        self.tokenizers = Tokenizers()

    def _path_teacher(self, request: Request) -> str | None:
        """The teacher's name where the call came under `/teachers/{key}/` (None: every teacher)."""
        key = path_key(request.scope.get("state"))
        return None if key is None else self.service.router.route(key).name

    def models(self, request: Request) -> Response:
        """One entry per teacher (the base path's alone), as vLLM lists its model (id: the teacher's key)."""
        try:
            only = self._path_teacher(request)
        except ScoringError as error:
            return openai_error(error)
        data = [{"id": info.keys[0], "object": "model", "created": int(time.time()), "owned_by": "proctor",
                 "root": info.model or info.name, "parent": None, "max_model_len": info.max_model_len or None,
                 "permission": []} for info in self.service.teacher_infos() if only in (None, info.name)]
        return JSONResponse({"object": "list", "data": data})

    def ready(self, request: Request) -> bool:
        """vLLM's `/health`: the server scores (under a base path: that teacher has a replica in service)."""
        try:
            only = self._path_teacher(request)
        except ScoringError:
            return False
        if only is None:
            return self.service.ready()
        return self.service.state is ServiceState.SERVING and self.service.router.teachers[only].in_service()

    async def complete(self, request: Request) -> Response:
        """Read, check, score and answer one completions call; a client that leaves before its
        answer withdraws every prompt of it (499)."""
        try:
            raw = await read_body(request, self.max_body_bytes)
            call = await cancel_on_disconnect(request, self._score(request, raw))
        except ScoringError as error:  # the rules' words, under the names vLLM's request gives the fields
            return openai_error(named_by_surface(error, _VLLM_NAMES))
        except ClientGone:
            return client_gone()
        form = call.ask.form
        large = (self.responses.completion_is_large(call.prompts, call.ask.topk) or form.echo
                 or form.logprobs is not None)
        text = self.tokenizers.token_text(call.teacher_set, call.tokenizer)
        payload = await off_loop_if(large, partial(self.responses.completion, model=call.ask.model or call.teacher_set.keys[0],
                                                   form=form, tokenizer=call.tokenizer, text=text),
                                    call.prompts, call.scored)
        return Response(payload, media_type="application/json")

    async def _score(self, request: Request, raw: bytes) -> _Scored:
        large = len(raw) > INLINE_BODY_BYTES
        # A call's prompts are admitted one request each: more than the queue holds cannot be served.
        most = self.service.most_body_numbers(sequences=self.service.limits.max_queue_requests, score_ids=False)
        ask = await off_loop_if(large, _parse, raw, most)
        template = _template(ask, routing_key(self.service.router, path_key(request.scope.get("state")), ask.model, "model"))
        teacher_set = self.service.route(template)
        tokenizer = await self.tokenizers.tokenizer(teacher_set)
        if ask.logprobs is not None and tokenizer is None:
            raise invalid("logprobs", f"teacher {teacher_set.name!r} has no tokenizer here, so its tokens have no "
                          "text for OpenAI's logprobs: ask prompt_logprobs instead")
        texts = any(isinstance(prompt, str) for prompt in ask.prompts)
        built = await off_loop_if(large or texts, build_requests, ask, template, teacher_set.name, tokenizer)
        scored = await score_all(self.service, teacher_set, built.messages, request_timeout(request))
        return _Scored(ask, teacher_set, tokenizer, built.prompts, scored)
