"""The JSON bodies of the HTTP endpoints as pydantic models: one definition per endpoint gives
both its validation and its OpenAPI schema, so the two cannot drift apart (`/v1/score`'s
field list used to be written twice, and its schema lacked temperature and media).

Validation keeps the contract's errors, `invalid(field, ...)` with the same messages as ever,
checked in the same order: first each given field's outer JSON type, in the body's order,
against the model's own schema (`WireModel.outer_types`); then each field's own check, in the
model's order. Those checks are plain validators that raise ScoringError themselves (pydantic
lets any other exception through untouched), so pydantic never walks a large list on its own:
the checks' Python loops let a worker thread decoding a 20 MB body hand the GIL back to the
event loop, and nothing is copied.
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
from collections.abc import Callable
from typing import Annotated, Any, Self

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.fields import FieldInfo

from proctor.proto import scoring_pb2
from proctor.server.common.errors import invalid
from proctor.server.front.ids import INT32, extend_ids, int32_ids
from proctor.server.front.media_fields import processor_kwargs

Int32 = Annotated[int, Field(ge=INT32.start, le=INT32.stop - 1)]
# Padded score_ids a JSON body may expand to (ragged rows are padded to the longest): bounds the
# allocation before validation, which then holds K to the teacher's max_topk.
_MAX_SCORE_ID_CELLS = 1 << 24
# Ragged score_ids rows are padded to the widest: at most this many times the ids given (or
# the free cells below), so the padded array grows with the body, never past it.
_RAGGED_SLACK = 8
_RAGGED_FREE_CELLS = 1 << 16
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "boolean": (bool,), "array": (list,), "object": (dict,), "number": (int, float),
}


class _Absent:
    """What a `required()` field's check is given when the body leaves the field out."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def required(description: str) -> Any:
    """A field the body must give, whose check says so in its own turn (pydantic's `missing`
    would be reported after every later field's check instead)."""
    return Field(default_factory=lambda: ABSENT, validate_default=True, description=description)


def checked(check: Callable[..., Any], wire_type: Any) -> PlainValidator:
    """A field validated by `check` alone (raising ScoringError), documented as `wire_type`."""
    return PlainValidator(check, json_schema_input_type=wire_type)


def _mark_required(schema: dict[str, Any], model: type[BaseModel]) -> None:
    schema.setdefault("required", []).extend(
        name for name, field in model.model_fields.items() if _is_required(field))


def _is_required(field: FieldInfo) -> bool:
    return field.default_factory is not None and field.validate_default is True


class WireModel(BaseModel):
    """A body of the wire: strict, closed (unknown fields are refused), `required()` fields
    listed as required in the schema."""

    model_config = ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True,
                              json_schema_extra=_mark_required)

    @classmethod
    def check(cls, body: Any) -> Self:
        """The validated body, or ScoringError naming what is wrong."""
        if not isinstance(body, dict):
            raise invalid("body", "must be a JSON object")
        try:
            return cls.model_validate(body)
        except ValidationError as exc:  # a guard: every field's own check answers before pydantic
            error = exc.errors()[0]
            raise invalid(".".join(map(str, error["loc"])) or "body", error["msg"]) from None

    @classmethod
    def outer_types(cls) -> dict[str, list[dict[str, Any]]]:
        """Field name -> the JSON schemas its value may match (null left out), in field order."""
        return _outer_types(cls)

    @classmethod
    def openapi_body(cls, **other_media: dict[str, Any]) -> dict[str, Any]:
        """The endpoint's `openapi_extra`: this model as its JSON body, beside `other_media`."""
        content = {"application/json": {"schema": _inline_refs(cls.model_json_schema())}, **other_media}
        return {"requestBody": {"required": True, "content": content}}


@functools.cache
def _outer_types(model: type[BaseModel]) -> dict[str, list[dict[str, Any]]]:
    properties = model.model_json_schema()["properties"]
    return {name: [member for member in prop.get("anyOf", [prop]) if member.get("type") != "null"]
            for name, prop in properties.items()}


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its `$defs` written in place, as an inline OpenAPI body schema needs
    (a `#/$defs/...` reference would point into the OpenAPI document's root)."""
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return inline(schema)


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"an integer of {len(text)} digits"


def check_outer_type(key: str, value: Any, members: list[dict[str, Any]]) -> None:
    """One given field's outer JSON type, and an integer's range; what is inside a list or an
    object is the field's own check."""
    integer = next((member for member in members if member.get("type") == "integer"), None)
    if integer is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(key, f"must be an integer, got {type(value).__name__}")
        if not integer["minimum"] <= value <= integer["maximum"]:
            raise invalid(key, f"is {_short(value)}, outside the int32 range")
    elif not isinstance(value, tuple(t for member in members for t in _PYTHON_TYPES[member["type"]])):
        raise invalid(key, f"has the wrong type {type(value).__name__}")


def _token_ids(ids: list[int] | _Absent | None) -> list[int]:
    if ids is None or ids is ABSENT:
        raise invalid("token_ids", "is required")
    assert isinstance(ids, list)  # the outer type is checked first
    int32_ids("token_ids", ids)
    return ids


def _teacher_prompt_ids(ids: list | None) -> list[int] | None:
    if ids is None:
        return None
    int32_ids("teacher_prompt_ids", ids)
    return ids


def _messages(items: list | None) -> list[scoring_pb2.AlignedMessage] | None:
    """A conversation as {"role", "content"} objects of strings, the wire's AlignedMessages."""
    if items is None:
        return None
    out = []
    for index, item in enumerate(items):
        if (not isinstance(item, dict) or set(item) != {"role", "content"}
                or not all(isinstance(v, str) for v in item.values())):
            raise invalid(f"messages[{index}]", 'must be {"role": "...", "content": "..."} (strings)')
        out.append(scoring_pb2.AlignedMessage(role=item["role"], content=item["content"]))
    return out


def _media(items: list | None, info: ValidationInfo) -> list[scoring_pb2.Media]:
    """JSON's own rules of media items (an object of strings, its data in base64); whether an item
    is empty or lacks its type is the rule of every surface (`media_fields`, applied by validation)."""
    field = info.field_name
    out = []
    for index, item in enumerate(items or ()):
        if not isinstance(item, dict) or not all(isinstance(item.get(key, ""), str) for key in ("data", "media_type")):
            raise invalid(f"{field}[{index}]", 'must be {"data": <base64>, "media_type": "..."}')
        try:
            data = base64.b64decode(item.get("data", ""), validate=True)
        except ValueError as exc:  # binascii.Error is a ValueError, as is non-ASCII text
            raise invalid(f"{field}[{index}].data", "is not valid base64") from exc
        out.append(scoring_pb2.Media(data=data, media_type=item.get("media_type", "")))
    return out


def _processor_kwargs(kwargs: dict | str | None) -> str:
    """mm_processor_kwargs as the JSON text the wire carries; a string is read here by the rule of
    every surface (`media_fields`), off the loop with the body, so that hostile text is refused
    before the service sees it."""
    if not kwargs:
        return ""
    if isinstance(kwargs, dict):
        return json.dumps(kwargs)
    processor_kwargs(kwargs)
    return kwargs


def json_temperature(value: Any) -> float | None:
    """temperature as JSON carries it: a number (not a bool), or null. Its value is checked by the
    rule of every surface, in `front.validation`, which also knows whether the teacher applies it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid("temperature", f"must be a number, got {type(value).__name__}")
    return float(value)


def refuse_sampled_token(temperature: float | None) -> None:
    """A generating surface asked for a token's log-probs at a temperature other than 0: that token
    would be sampled, and proctor generates greedily only (the rule of every generating surface)."""
    raise invalid("temperature", f"is {temperature!r}; logprobs with max_tokens 1 asks for a generated token, "
                  "and this server generates greedily only: send temperature 0 (or echo with max_tokens 0)")


def padded_id_rows(rows: list[list], field: str) -> np.ndarray:
    """R lists of ids (ragged allowed) -> int32 [R, K] with -1 padding, every id held to int32
    (`int32_ids`) and the padding bounded by what was sent: a few ragged rows must not allocate
    [rows, widest]. Rows of one width (the usual case) become the array in one numpy call."""
    width = max((len(row) for row in rows), default=0)
    given = sum(len(row) for row in rows)
    if len(rows) * width > min(_MAX_SCORE_ID_CELLS, max(_RAGGED_SLACK * given, _RAGGED_FREE_CELLS)):
        raise invalid(field, f"{len(rows)} rows of up to {width} ids ({given} given) pad to "
                      f"{len(rows) * width} cells; pad the rows with -1 to one width yourself, or send fewer")
    int32_ids(field, list(itertools.chain.from_iterable(rows)))  # a list: int32_ids checks it in C passes
    if given == len(rows) * width:
        return np.asarray(rows, dtype="<i4").reshape(len(rows), width)
    ids = np.full((len(rows), width), -1, dtype="<i4")
    for index, row in enumerate(rows):
        ids[index, : len(row)] = row
    return ids


def _score_ids(rows: list | None) -> scoring_pb2.Tensor | None:
    """score_ids as R lists of ids (ragged allowed) -> int32 [R, K] with -1 padding, the wire form."""
    if rows is None:
        return None
    if not all(isinstance(row, list) for row in rows):
        raise invalid("score_ids", "must be a list of rows, each a list of token ids")
    ids = padded_id_rows(rows, "score_ids")
    return scoring_pb2.Tensor(dtype=scoring_pb2.INT32, shape=list(ids.shape), data=ids.tobytes())


class MediaItem(BaseModel):
    """One image, video or audio: its bytes in base64 and their media type."""

    data: str = Field(description="the file's bytes in base64", json_schema_extra={"contentEncoding": "base64"})
    media_type: str = Field(description='its media type, e.g. "image/png"')


class MessageItem(BaseModel):
    """One turn of the teacher's conversation."""

    role: str = Field(description='e.g. "user"')
    content: str


_Media = Annotated[list[scoring_pb2.Media] | None, checked(_media, list[MediaItem] | None)]


class ScoreBody(WireModel):
    """`POST /v1/score` (and `/v1/score/stream`) as JSON: the `ScoreRequest` message's fields,
    media in base64 and `score_ids` as lists of ids."""

    request_id: str | None = Field(None, description="echoed in the answer; one is made when empty")
    teacher_key: str | None = Field(None, description="the teacher to score with (optional with one)")
    token_ids: Annotated[list[int], checked(_token_ids, list[Int32])] = required("the sequence to score")
    prompt_length: Int32 | None = Field(None, description="rows before it are not answered")
    logprobs: bool | None = Field(True, description="the log-prob of each actual next token")
    topk: Int32 | None = Field(None, description="the teacher's top-k ids and log-probs per row")
    hidden_states: bool | None = Field(False, description="the last hidden state of each row")
    hidden_form: str | None = Field(None, description="the hidden states' wire form (TeacherInfo.hidden_forms)")
    images: _Media = None
    videos: _Media = None
    audios: _Media = None
    mm_processor_kwargs: Annotated[str | None, checked(_processor_kwargs, dict[str, Any] | str | None)] = None
    temperature: Annotated[float | None, checked(json_temperature, float | None)] = Field(
        None, description="divides the teacher's logits before the log-softmax")
    score_ids: Annotated[scoring_pb2.Tensor | None, checked(_score_ids, list[list[Int32]] | None)] = Field(
        None, description="per row, the ids whose log-probs to answer (rows may be ragged)")
    student_tokenizer: str | None = Field(
        None, description="a student tokenizer of the server: token_ids are the student's, the answer is aligned")
    teacher_prompt_ids: Annotated[list[int] | None, checked(_teacher_prompt_ids, list[Int32] | None)] = Field(
        None, description="with student_tokenizer: the teacher's prompt as its own ids")
    messages: Annotated[list[scoring_pb2.AlignedMessage] | None, checked(_messages, list[MessageItem] | None)] = Field(
        None, description="with student_tokenizer: the teacher's prompt as a conversation for its chat template")
    replica: str | None = Field(None, description="pin to this replica of the teacher (a replica_id of "
                                "/v1/teachers), with no failover: for comparing replicas")
    cache_salt: str | None = Field(None, description="scopes prompt reuse: only requests of the same salt share "
                                   "computed prefixes (vLLM's cache_salt)")

    @model_validator(mode="before")
    @classmethod
    def _known_and_typed(cls, body: Any) -> Any:
        """Every given field known and of its JSON type, in the body's order (the first wrong
        one is named), before any field's own check."""
        fields = cls.outer_types()
        for key, value in body.items():
            if key not in fields:
                raise invalid(key, f"unknown field (known: {', '.join(fields)})")
            if value is not None:
                check_outer_type(key, value, fields[key])
        return body

    def message(self) -> scoring_pb2.ScoreRequest:
        """The wire message this body stands for."""
        request = scoring_pb2.ScoreRequest(
            request_id=self.request_id or "", teacher_key=self.teacher_key or "", logprobs=bool(self.logprobs),
            topk=self.topk or 0, hidden_states=bool(self.hidden_states), hidden_form=self.hidden_form or "")
        extend_ids(request.token_ids, self.token_ids)
        if self.prompt_length is not None:
            request.prompt_length = self.prompt_length
        for media, items in (("images", self.images), ("videos", self.videos), ("audios", self.audios)):
            getattr(request, media).extend(items or ())
        if self.mm_processor_kwargs:
            request.mm_processor_kwargs = self.mm_processor_kwargs
        if self.temperature is not None:
            request.temperature = self.temperature
        if self.score_ids is not None:
            request.score_ids.CopyFrom(self.score_ids)
        request.student_tokenizer = self.student_tokenizer or ""
        request.teacher_prompt_ids.extend(self.teacher_prompt_ids or ())
        request.messages.extend(self.messages or ())
        if self.replica:
            request.replica = self.replica
        request.cache_salt = self.cache_salt or ""
        return request
