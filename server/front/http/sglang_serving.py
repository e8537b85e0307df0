"""SGLang's native surface served over the ScoringService: `/generate` and the calls its clients
make first (`/health_generate`, `/get_model_info`, `/get_server_info`).

A `/generate` call is read (the HTTP shell's body rules), checked (`GenerateBody`), routed once
by the service, its text prompts tokenized with the teacher's tokenizer, each prompt planned
into a `ScoreRequest` (`sglang_compat.plan`) and scored like any `/v1/score` call (the prompts
of a batch at once, `completions_serving.score_all`); the answer is `Responses.generate`. SGLang
requests name no model: the teacher is the one the path names (`/teachers/{key}/generate`), or
the only one. Work that grows with the call runs in a worker thread once it is large.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proctor.proto import scoring_pb2
from proctor.server.common.errors import Code, ScoringError, invalid
from proctor.server.common.off_loop import off_loop_if
from proctor.server.front.bounded_json import loads_bounded
from proctor.server.front.fleet.routing import ReplicaSet
from proctor.server.front.generate_json import EntryText, Finish, Planned
from proctor.server.front.http.cancellation import ClientGone, cancel_on_disconnect, client_gone
from proctor.server.front.http.completions_serving import score_all
from proctor.server.front.http.errors import sglang_error
from proctor.server.front.http.request import INLINE_BODY_BYTES, read_body, request_timeout
from proctor.server.front.http.sglang_compat import GenerateBody, GenerateItem, plan
from proctor.server.front.http.teacher_paths import path_key
from proctor.server.front.http.teacher_tokenizers import Tokenizers, model_dir
from proctor.server.front.responses import Responses
from proctor.server.front.service import ScoredRequest, ScoringService

# Positions before a generated token that SGLang's detokenizer decodes with it, so that the
# token's text is what it adds in context (a leading space, a merged character).
_DETOKENIZE_CONTEXT = 5
# Entries ([logprob, id, text]) past which an answer is written on a worker thread.
_INLINE_ENTRIES = 20_000


def teacher_key(request: Request) -> str:
    """The teacher a call's path names (`/teachers/{key}/...`, `teacher_paths`), or "" for the
    bare path (SGLang's requests name no model)."""
    return path_key(request.scope.get("state")) or ""


def _parse(raw: bytes, most: int | None) -> GenerateBody:
    return GenerateBody.check(loads_bounded(raw, field="body", max_numbers=most))


def eos_ids(tokenizer: Any, directory: Path | None) -> frozenset[int]:
    """The ids a generation stops at, as SGLang gathers them: the tokenizer's end of sequence and
    the model's `eos_token_id` (config.json and generation_config.json; an id or a list)."""
    found: set[int] = set()
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        found.add(int(tokenizer.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        path = directory / name if directory is not None else None
        if path is None or not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        found.update(int(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return frozenset(found)


def finish(item: GenerateItem, plan_: Planned, scored: ScoredRequest, tokenizer: Any, stops: frozenset[int]) -> Finish:
    """What the prompt generated: nothing (max_new_tokens 0), or the greedy token, its text as
    SGLang's detokenizer gives it (decoded after the prompt's last positions, a matched stop
    token trimmed unless no_stop_trim) and the finish reason SGLang reports."""
    sampling = item.sampling
    if not sampling.max_new_tokens:
        return Finish("", [], {"type": "length", "length": 0})
    row = len(plan_.ids) - scored.result.first_row
    token = int(scored.result.topk_ids[row, 0])
    stop = token in sampling.stop_token_ids or (not sampling.ignore_eos and token in stops)
    reason = {"type": "stop", "matched": token} if stop else {"type": "length", "length": 1}
    text = ""
    if tokenizer is not None and not (stop and not sampling.no_stop_trim):
        context = plan_.ids[-_DETOKENIZE_CONTEXT:]
        options = {"skip_special_tokens": sampling.skip_special_tokens,
                   "spaces_between_special_tokens": sampling.spaces_between_special_tokens}
        text = tokenizer.decode([*context, token], **options)[len(tokenizer.decode(context, **options)):]
    return Finish(text, [token], reason)


@dataclass(frozen=True)
class _Scored:
    """A `/generate` call scored: what its answer is made of."""

    body: GenerateBody
    teacher_set: ReplicaSet
    tokenizer: Any
    plans: list[Planned]
    scored: list[ScoredRequest]


def _planned(body: GenerateBody, teacher_set: ReplicaSet, key: str, tokenizer: Any) -> list[Planned]:
    """Each prompt's ids (text through the teacher's tokenizer) and its ScoreRequest."""
    # as the wire carries it: the rule of every surface (`media_fields.processor_kwargs`) refuses a non-object
    kwargs = json.dumps(body.mm_processor_kwargs) if body.mm_processor_kwargs is not None else ""
    plans = []
    for index, item in enumerate(body.items):
        ids = item.prompt
        if isinstance(ids, str):
            if tokenizer is None:
                raise invalid("text", f"teacher {teacher_set.name!r} has no tokenizer here: send input_ids "
                              f"(prompt {index})")
            ids = list(tokenizer.encode(ids))
        plans.append(plan(item, ids, teacher_key=key, mm_processor_kwargs=kwargs))
    return plans


class SglangServing:
    """SGLang's `/generate`, `/health_generate`, `/get_model_info` and `/get_server_info`."""

    def __init__(self, service: ScoringService, responses: Responses, tokenizers: Tokenizers, *,
                 max_body_bytes: int) -> None:
        self.service = service
        self.responses = responses
        self.tokenizers = tokenizers
        self.max_body_bytes = max_body_bytes
        self._texts: dict[str, EntryText] = {}
        self._stops: dict[str, frozenset[int]] = {}

    def route(self, key: str) -> ReplicaSet:
        """The teacher of a call: the path's key, or the only teacher. With several teachers and
        no key the refusal says how to choose (SGLang's requests name no model)."""
        try:
            return self.service.route(scoring_pb2.ScoreRequest(teacher_key=key))
        except ScoringError as error:
            if key or error.code is not Code.INVALID_ARGUMENT:
                raise
            raise ScoringError(error.code, f"{error.message}; SGLang's requests name no model: call "
                               "/teachers/<key>/generate", field=error.field) from None

    async def generate(self, request: Request) -> Response:
        """Read, check, score and answer one `/generate` call; a client that leaves before its
        answer withdraws every prompt of it (499)."""
        started = time.monotonic()
        try:
            raw = await read_body(request, self.max_body_bytes)
            call = await cancel_on_disconnect(request, self._score(request, raw))
        except ScoringError as error:
            return sglang_error(error)
        except ClientGone:
            return client_gone()
        finishes = [finish(item, p, s, call.tokenizer, self._stop_ids(call.teacher_set, call.tokenizer))
                    for item, p, s in zip(call.body.items, call.plans, call.scored, strict=True)]
        text = self._entry_text(call.teacher_set, call.tokenizer) if call.body.return_text_in_logprobs else None
        large = sum(len(p.message.token_ids) * (1 + p.top_logprobs_num + len(p.token_ids_logprob or ()))
                    for p in call.plans) > _INLINE_ENTRIES or any(p.hidden_states for p in call.plans)
        payload = await off_loop_if(large, partial(self.responses.generate, batch=call.body.batch, text=text,
                                                   latency=time.monotonic() - started),
                                    call.plans, call.scored, finishes)
        return Response(payload, media_type="application/json")

    async def _score(self, request: Request, raw: bytes) -> _Scored:
        large = len(raw) > INLINE_BODY_BYTES
        # a batch's prompts are admitted one request each, each with its token_ids_logprob (a row's
        # worth at most): a body with more numbers than that is refused before its parse
        most = self.service.most_body_numbers(sequences=self.service.limits.max_queue_requests, score_ids=False)
        body = await off_loop_if(large, _parse, raw, None if most is None else 2 * most)
        key = teacher_key(request)
        teacher_set = self.route(key)
        tokenizer = await self.tokenizers.tokenizer(teacher_set)
        texts = any(isinstance(item.prompt, str) for item in body.items)
        plans = await off_loop_if(large or texts, _planned, body, teacher_set, key, tokenizer)
        scored = await score_all(self.service, teacher_set, [p.message for p in plans], request_timeout(request),
                                 ranks=False)
        return _Scored(body, teacher_set, tokenizer, plans, scored)

    def _entry_text(self, teacher_set: ReplicaSet, tokenizer: Any) -> EntryText:
        text = self._texts.get(teacher_set.name)
        if text is None:
            text = self._texts[teacher_set.name] = EntryText(tokenizer)
        return text

    def _stop_ids(self, teacher_set: ReplicaSet, tokenizer: Any) -> frozenset[int]:
        stops = self._stops.get(teacher_set.name)
        if stops is None:
            stops = self._stops[teacher_set.name] = eos_ids(tokenizer, model_dir(teacher_set))
        return stops

    async def model_info(self, request: Request) -> Response:
        """SGLang's `/get_model_info` (and `/model_info`) for the path's teacher or the only one."""
        try:
            teacher_set = self.route(teacher_key(request))
            info = teacher_set.info
        except ScoringError as error:
            return sglang_error(error)
        config = _config(model_dir(teacher_set))
        return JSONResponse({
            "model_path": info.model or teacher_set.name, "served_model_name": teacher_set.keys[0],
            "tokenizer_path": teacher_set.tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": "images" in info.media, "has_audio_understanding": "audios" in info.media,
            "model_type": config.get("model_type"), "architectures": config.get("architectures"),
        })

    async def server_info(self, request: Request) -> Response:
        """SGLang's `/get_server_info` (and `/server_info`): the few settings clients read
        (model, context length, parallel sizes of one replica)."""
        try:
            teacher_set = self.route(teacher_key(request))
            info = teacher_set.info
        except ScoringError as error:
            return sglang_error(error)
        return JSONResponse({
            "model_path": info.model or teacher_set.name, "served_model_name": teacher_set.keys[0],
            "tokenizer_path": teacher_set.tokenizer_path, "context_length": info.max_model_len,
            "tp_size": 1, "pp_size": 1, "dp_size": 1, "disaggregation_mode": "null",
            "skip_tokenizer_init": teacher_set.tokenizer_path is None, "version": "proctor", "frontend": "proctor",
        })

    def health_generate(self) -> Response:
        """SGLang's deep probe: 200 when every teacher can score, 503 otherwise."""
        return Response(status_code=200 if self.service.ready() else 503)


def _config(directory: Path | None) -> dict[str, Any]:
    """The teacher's config.json, or {} when it has none here."""
    try:
        return json.loads((directory / "config.json").read_text()) if directory is not None else {}
    except (OSError, ValueError):
        return {}
