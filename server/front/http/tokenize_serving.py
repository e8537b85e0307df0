"""vLLM's `/tokenize` and `/detokenize` over the teachers' own tokenizers.

Evaluation harnesses (lm-eval's `local-completions`, lighteval) and hand-written clients of
`vllm serve` ask the server to tokenize: a text prompt (or chat `messages` through the teacher's
chat template) becomes the ids the teacher scores, and ids become text. The answers are vLLM's:
`{"count", "max_model_len", "tokens", "token_strs"}` and `{"prompt"}`; `model` (or the base path,
`teacher_paths`) picks the teacher, routed by the service's rule; errors take OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proctor.server.common.errors import ScoringError, invalid
from proctor.server.common.off_loop import off_loop_if
from proctor.server.front.bounded_json import loads_bounded
from proctor.server.front.fleet.routing import ReplicaSet
from proctor.server.front.http.errors import openai_error
from proctor.server.front.http.request import INLINE_BODY_BYTES, read_body
from proctor.server.front.http.teacher_paths import path_key, routing_key
from proctor.server.front.http.teacher_tokenizers import Tokenizers
from proctor.server.front.ids import int32_ids
from proctor.server.front.service import ScoringService

_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                    "add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
_DETOKENIZE_FIELDS = {"model", "tokens"}


def _parse(raw: bytes, most: int | None) -> Any:
    return loads_bounded(raw, field="body", max_numbers=most)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, "must be a boolean")
    return value


def _known(body: Any, fields: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    for key in body:
        if key not in fields:
            raise invalid(key, "is not a parameter of this endpoint")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string (a teacher key from /v1/models)")
    return body


def _encode(body: dict[str, Any], tokenizer: Any) -> list[int]:
    """The ids of a tokenize call: its `prompt`, or its chat `messages` through the chat template."""
    if ("prompt" in body) == ("messages" in body):
        raise invalid("prompt", "give either prompt (text) or messages (a chat)")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise invalid("prompt", "must be a string")
        return list(tokenizer.encode(body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True)))
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise invalid("messages", "must be a list of chat messages (objects with role and content)")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "must be an object")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=_flag(body, "add_generation_prompt", True),
            continue_final_message=_flag(body, "continue_final_message", False), **kwargs)
    except Exception as exc:  # no template, or one these messages do not fit
        raise invalid("messages", f"the teacher's chat template cannot render them ({exc})") from None
    return list(tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False)))


def _plain(value: Any) -> Any:
    """A tokenizer setting as JSON: special tokens as their text, the rest as they are or as text."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "content", None) or str(value)


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's `/tokenizer_info`: the tokenizer's settings (no file paths), its class and chat
    template; lm-eval reads it to tokenize through the server instead of loading the tokenizer."""
    info = {key: _plain(value) for key, value in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
            if key not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    info["tokenizer_class"] = type(tokenizer).__name__
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info.setdefault(name, _plain(getattr(tokenizer, name, None)))
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


class TokenizeServing:
    """`/tokenize` and `/detokenize` with each teacher's tokenizer (`Tokenizers`, shared with the
    completions surface so each is loaded once)."""

    def __init__(self, service: ScoringService, tokenizers: Tokenizers, *, max_body_bytes: int) -> None:
        self.service = service
        self.tokenizers = tokenizers
        self.max_body_bytes = max_body_bytes

    async def _call(self, request: Request, fields: set[str]) -> tuple[dict[str, Any], ReplicaSet, Any]:
        raw = await read_body(request, self.max_body_bytes)
        body = _known(await off_loop_if(len(raw) > INLINE_BODY_BYTES, _parse, raw,
                                        self.service.most_body_numbers(score_ids=False)), fields)
        key = routing_key(self.service.router, path_key(request.scope.get("state")), body.get("model") or "", "model")
        self.service.check_serving()
        teacher_set = self.service.router.route(key)
        tokenizer = await self.tokenizers.tokenizer(teacher_set)
        if tokenizer is None:
            raise invalid("model", f"teacher {teacher_set.name!r} has no tokenizer here")
        return body, teacher_set, tokenizer

    async def tokenize(self, request: Request) -> Response:
        """Text (or chat messages) -> the teacher's ids, as vLLM answers `/tokenize`."""
        try:
            body, teacher_set, tokenizer = await self._call(request, _TOKENIZE_FIELDS)
            ids = await off_loop_if(len(body.get("prompt") or "") > 4096, _encode, body, tokenizer)
        except ScoringError as error:
            return openai_error(error)
        strs = tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
        return JSONResponse({"count": len(ids), "max_model_len": teacher_set.info.max_model_len,
                             "tokens": ids, "token_strs": strs})

    async def info(self, request: Request) -> Response:
        """The teacher's tokenizer settings, as vLLM answers `/tokenizer_info`."""
        try:
            key = routing_key(self.service.router, path_key(request.scope.get("state")),
                              request.query_params.get("model", ""), "model")
            self.service.check_serving()
            teacher_set = self.service.router.route(key)
            tokenizer = await self.tokenizers.tokenizer(teacher_set)
            if tokenizer is None:
                raise invalid("model", f"teacher {teacher_set.name!r} has no tokenizer here")
        except ScoringError as error:
            return openai_error(error)
        return JSONResponse(tokenizer_info(tokenizer))

    async def detokenize(self, request: Request) -> Response:
        """The teacher's ids -> text, as vLLM answers `/detokenize`."""
        try:
            body, teacher_set, tokenizer = await self._call(request, _DETOKENIZE_FIELDS)
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise invalid("tokens", "must be a list of token ids")
            int32_ids("tokens", tokens)
            vocab = teacher_set.info.vocab_size
            if vocab and any(token < 0 or token >= vocab for token in tokens):
                raise invalid("tokens", f"holds ids outside the teacher's vocabulary [0, {vocab})")
            text = await off_loop_if(len(tokens) > 4096, tokenizer.decode, tokens)
        except ScoringError as error:
            return openai_error(error)
        return JSONResponse({"prompt": text})
