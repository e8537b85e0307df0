"""vLLM's token-in-token-out teacher scoring served over the ScoringService: `/inference/v1/generate`.

A call is read (the HTTP shell's body rules), checked (`GenerateBody`), turned into one
`ScoreRequest` over the prompt and one token more (`GeneratePlan`: the extra row is the greedy
next token vLLM's answer carries), routed by the service (its key: `model`), and scored by
`ScoringService.score_on` like any `/v1/score` call: validated by the rules' homes, admitted,
counted, behind the token. The service's refusals name proctor's fields; here they are named as
the client wrote them (`score_ids` is `sampling_params.prompt_logprob_token_ids`, ...), in
vLLM's error shape (`openai_error`). The answer is `Responses.generate`. Work that grows with the
call (the body's parse, the request's ids, the answer) runs in a worker thread once it is large.
"""

from __future__ import annotations

import json
import uuid
from functools import partial
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from proctor.proto import scoring_pb2
from proctor.server.common.errors import ScoringError, invalid
from proctor.server.common.off_loop import off_loop_if
from proctor.server.engines.teacher_serves import sequence_problem
from proctor.server.front.bounded_json import loads_bounded
from proctor.server.front.fleet.routing import ReplicaSet
from proctor.server.front.http.cancellation import ClientGone, cancel_on_disconnect, client_gone
from proctor.server.front.http.errors import named_by_surface, openai_error
from proctor.server.front.http.request import INLINE_BODY_BYTES, read_body, request_timeout
from proctor.server.front.http.teacher_paths import path_key, routing_key
from proctor.server.front.http.teacher_tokenizers import Tokenizers, model_dir
from proctor.server.front.http.tito_compat import SAMPLING, GenerateBody
from proctor.server.front.ids import extend_ids
from proctor.server.front.responses import COMPLETION_INLINE_CELLS, Responses
from proctor.server.front.service import ScoredRequest, ScoringService
from proctor.server.front.tito_json import GeneratePlan, GenerateReply

# The service's field names -> this surface's (the rest are the same on both).
_FIELDS = {
    "score_ids": f"{SAMPLING}.prompt_logprob_token_ids",
    "topk": f"{SAMPLING}.prompt_logprobs",
    "prompt_length": f"{SAMPLING}.prompt_logprob_start",
    "teacher_key": "model",
}


def plan_of(ask: GenerateBody) -> GeneratePlan:
    """The rows of the one scored request: from row 1 with prompt_logprobs (they cover every
    position), else from the first scored id row, else the generated token's row alone."""
    sampling, count = ask.sampling_params, len(ask.token_ids)
    ids = sampling.prompt_logprob_token_ids
    id_rows = 0 if ids is None else ids.shape[0]
    if sampling.prompt_logprobs is not None:
        first = 1
    elif id_rows:
        first = ask.start + 1
    else:
        first = count
    return GeneratePlan(num_prompt=count, first_row=first, prompt_topk=sampling.prompt_logprobs, id_rows=id_rows,
                        id_start=ask.start, choice_logprobs=sampling.logprobs)


def build_request(ask: GenerateBody, plan: GeneratePlan) -> scoring_pb2.ScoreRequest:
    """The ScoreRequest: the prompt and one token more (its last id again: any id would do, its
    row is the distribution after the prompt), the candidate ids placed at their rows, -1 in the
    rows around them."""
    message = scoring_pb2.ScoreRequest(teacher_key=ask.model or "", logprobs=plan.prompt_topk is not None,
                                       topk=plan.topk, prompt_length=plan.first_row, cache_salt=ask.cache_salt or "")
    extend_ids(message.token_ids, ask.token_ids)
    message.token_ids.append(ask.token_ids[-1])
    ids = ask.sampling_params.prompt_logprob_token_ids
    if ids is not None:
        matrix = np.full((plan.num_prompt + 1 - plan.first_row, ids.shape[1]), -1, dtype="<i4")
        first = plan.id_start + 1 - plan.first_row
        matrix[first : first + plan.id_rows] = ids
        message.score_ids.CopyFrom(scoring_pb2.Tensor(dtype=scoring_pb2.INT32, shape=list(matrix.shape),
                                                      data=matrix.tobytes()))
    return message


def _eos_ids(teacher_set: ReplicaSet, tokenizer: Any) -> frozenset[int]:
    """The ids that end a generation as vLLM ends it: the tokenizer's EOS and the model's
    generation config's."""
    ids = set()
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = model_dir(teacher_set)
    config = path / "generation_config.json" if path is not None else None
    if config is not None and config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int))
    return frozenset(ids)


def _parse(raw: bytes, most: int | None) -> GenerateBody:
    return GenerateBody.check(loads_bounded(raw, field="body", max_numbers=most))


def _prepare(raw: bytes, most: int | None) -> tuple[GenerateBody, GeneratePlan, scoring_pb2.ScoreRequest]:
    ask = _parse(raw, most)
    plan = plan_of(ask)
    return ask, plan, build_request(ask, plan)


def _cells(plan: GeneratePlan, ask: GenerateBody) -> int:
    ids = ask.sampling_params.prompt_logprob_token_ids
    return plan.num_prompt * ((plan.prompt_topk or 0) + 1) + (0 if ids is None else ids.size)


class TitoServing:
    """`/inference/v1/generate` over one ScoringService."""

    def __init__(self, service: ScoringService, responses: Responses, tokenizers: Tokenizers, *,
                 max_body_bytes: int) -> None:
        self.service = service
        self.responses = responses
        self.tokenizers = tokenizers
        self.max_body_bytes = max_body_bytes
        self._eos: dict[str, frozenset[int]] = {}

    async def generate(self, request: Request) -> Response:
        """Read, check, score and answer one call; a client that leaves before its answer
        withdraws it (499)."""
        try:
            raw = await read_body(request, self.max_body_bytes)
            ask, plan, reply, scored, teacher_set, tokenizer = await cancel_on_disconnect(
                request, self._score(request, raw))
        except ScoringError as error:
            return openai_error(named_by_surface(error, _FIELDS))
        except ClientGone:
            return client_gone()
        text = self.tokenizers.token_text(teacher_set, tokenizer)
        payload = await off_loop_if(_cells(plan, ask) > COMPLETION_INLINE_CELLS,
                                    partial(self.responses.tito, text=text), plan, reply, scored)
        return Response(payload, media_type="application/json")

    async def _score(self, request: Request, raw: bytes) -> tuple:
        # one sequence and its candidate ids per row: a body with more numbers is refused before its parse
        ask, plan, message = await off_loop_if(len(raw) > INLINE_BODY_BYTES, _prepare, raw,
                                               self.service.most_body_numbers())
        message.teacher_key = routing_key(self.service.router, path_key(request.scope.get("state")),
                                          message.teacher_key, "model")
        teacher_set = self.service.route(message)
        problem = sequence_problem(teacher_set.info, teacher_set.name, plan.num_prompt + 1)
        if problem is not None:
            raise invalid("token_ids", f"{problem[1]}, counting the position of the one generated token: "
                          f"send at most {teacher_set.info.max_sequence_tokens - 1}")
        tokenizer = await self.tokenizers.tokenizer(teacher_set)
        if teacher_set.name not in self._eos:
            self._eos[teacher_set.name] = _eos_ids(teacher_set, tokenizer)
        stop_ids = frozenset() if ask.sampling_params.ignore_eos else self._eos[teacher_set.name]
        scored: ScoredRequest = await self.service.score_on(
            teacher_set, message, timeout=request_timeout(request), unary=True, ranks=plan.prompt_topk is not None)
        base = request.headers.get("x-request-id") or ask.request_id or uuid.uuid4().hex
        reply = GenerateReply(request_id=f"generate-tokens-{base}", model=ask.model or teacher_set.keys[0],
                              prompt=ask.token_ids, return_token_ids=ask.return_token_ids, stop_ids=stop_ids)
        return ask, plan, reply, scored, teacher_set, tokenizer
