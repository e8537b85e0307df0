"""vLLM's token-in-token-out teacher scoring on proctor's HTTP port: its request.

vLLM 0.32 scores a student's tokens on `POST /inference/v1/generate` (its scale-out,
token-in-token-out endpoint): `token_ids`, and in `sampling_params` `max_tokens: 1`,
`prompt_logprobs: K` (the top-K per prompt position) and `prompt_logprob_token_ids` (one list
of candidate ids per scored row, e.g. the student's top-K, from row `prompt_logprob_start`),
answered as `prompt_logprobs` JSON and `prompt_token_id_logprobs`, a base64 `.npy` float32
matrix [rows, K]. Trainers written against that call (verl's student-top-k distillation) reach
a proctor teacher unchanged, `model` being the teacher key; every call goes through the same
`ScoringService` as `/v1/score` (`tito_serving` serves it).

This module is that contract's request: `GenerateBody` and its `SamplingBody`, pydantic models
whose fields are the parameters served, those accepted at their neutral value only (refused
otherwise, naming the field: a scoring server must not half-serve a generation), and those
ignored, so that validation and the OpenAPI schema are one list. vLLM's own rules are kept where
they are its request's (ids non-negative, one row per scored position, `prompt_logprob_start`
only with `prompt_logprob_token_ids`); what the teacher serves (vocabulary, K, length) is checked
by the service's rule homes, as for every surface.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import PrivateAttr, ValidationInfo, model_validator

from proctor.server.common.errors import invalid
from proctor.server.front.http.models import ABSENT, Int32, WireModel, checked, padded_id_rows, required
from proctor.server.front.http.openai_compat import Neutral, _ignored, _neutral
from proctor.server.front.ids import int32_ids

SAMPLING = "sampling_params"
_NOT_SCORING = ("is not supported: this server scores prompts (prompt_logprobs, prompt_logprob_token_ids) "
                "and generates only the teacher's greedy next token")


def _name(info: ValidationInfo) -> str:
    """The field's name as the client wrote it, sampling parameters under `sampling_params.`."""
    return f"{SAMPLING}.{info.field_name}" if info.config and info.config.get("title") == "SamplingBody" \
        else str(info.field_name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any, info: ValidationInfo) -> int | None:
    """An optional count >= 0 (`prompt_logprobs`, `logprobs`)."""
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise invalid(_name(info), f"is {value!r}; it must be an integer >= 0 (-1, the whole vocabulary, "
                      "is not served: ask prompt_logprob_token_ids for the ids you need)")
    return value


def _max_tokens(value: Any, info: ValidationInfo) -> int:
    if value is ABSENT or not _is_int(value) or value != 1:
        raise invalid(_name(info), f"is {None if value is ABSENT else value!r}; this server scores the prompt and "
                      "generates one token: send max_tokens 1")
    return value


def _temperature(value: Any, info: ValidationInfo) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise invalid(_name(info), f"is {value!r}; it must be a number >= 0")
    return float(value)


def _flag(value: Any, info: ValidationInfo) -> bool:
    if value is None:  # vLLM's own models write an unset flag as null
        return False
    if not isinstance(value, bool):
        raise invalid(_name(info), "must be a boolean")
    return value


def _start(value: Any, info: ValidationInfo) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise invalid(_name(info), f"is {value!r}; it must be an integer >= 0")
    if info.data.get("prompt_logprob_token_ids") is None:
        raise invalid(_name(info), "requires prompt_logprob_token_ids")
    return value


def _id_rows(value: Any, info: ValidationInfo) -> np.ndarray | None:
    """One list of candidate ids per scored row -> int32 [rows, K], ragged rows padded with -1
    (vLLM pads so too); -1 is the only id below 0 it takes."""
    if value is None:
        return None
    field = _name(info)
    if not isinstance(value, list) or not value or not all(isinstance(row, list) for row in value) \
            or not any(value):
        raise invalid(field, "must be a non-empty list of rows [num_rows, num_ids], each a list of token ids")
    return padded_id_rows(value, field)


def _token_ids(value: Any) -> list[int]:
    if value is ABSENT or not isinstance(value, list) or not value:
        raise invalid("token_ids", "is required: a non-empty list of token ids")
    int32_ids("token_ids", value)
    if min(value) < 0:
        raise invalid("token_ids", "must not contain negative values")
    return value


def _sampling(value: Any) -> SamplingBody:
    if value is ABSENT or not isinstance(value, dict):
        raise invalid(SAMPLING, "is required: an object with max_tokens 1 and what to score")
    return SamplingBody.check(value)


def _string(value: Any, info: ValidationInfo) -> str | None:
    if value is not None and not isinstance(value, str):
        raise invalid(_name(info), "must be a string")
    return value


def _cache_salt(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= 1024):
        raise invalid("cache_salt", "must be a string of 1 to 1024 characters")
    return value


def _closed(model: type[WireModel], body: dict, prefix: str) -> None:
    """Every parameter known, each neutral one at its neutral value, in the body's order."""
    for key, value in body.items():
        field = model.model_fields.get(key)
        if field is None:
            raise invalid(prefix + key, _NOT_SCORING)
        neutral = next((item for item in field.metadata if isinstance(item, Neutral)), None)
        if neutral is not None and value is not None and value not in neutral.values:
            raise invalid(prefix + key, f"is {value!r}; only its neutral value is served here (scoring: "
                          "max_tokens 1 with prompt_logprobs or prompt_logprob_token_ids)")


_Count = Annotated[int | None, checked(_count, int | None)]


class SamplingBody(WireModel):
    """`sampling_params` as this server serves it: the prompt scored, one greedy token generated."""

    # Served, checked in this order.
    max_tokens: Annotated[int, checked(_max_tokens, int)] = required("1: the one generated token")
    prompt_logprobs: _Count = None
    prompt_logprob_token_ids: Annotated[np.ndarray | None, checked(_id_rows, list[list[Int32]] | None)] = None
    prompt_logprob_start: Annotated[int | None, checked(_start, int | None)] = None
    logprobs: _Count = None
    # vLLM's prompt scores are the raw log-probs whatever the temperature; it only changes how the
    # generated token is drawn, and here that token is always the greedy one.
    temperature: Annotated[float, checked(_temperature, float | None)] = 1.0
    ignore_eos: Annotated[bool, checked(_flag, bool | None)] = False
    # Accepted at their neutral value only.
    n: _neutral(int, 1) = None
    presence_penalty: _neutral(float, 0, 0.0) = None
    frequency_penalty: _neutral(float, 0, 0.0) = None
    repetition_penalty: _neutral(float, 1, 1.0) = None
    top_p: _neutral(float, 1, 1.0) = None
    top_k: _neutral(int, 0, -1) = None
    min_p: _neutral(float, 0, 0.0) = None
    stop: _neutral(list[str] | str, (), [], "") = None
    stop_token_ids: _neutral(list[int], (), []) = None
    min_tokens: _neutral(int, 0) = None
    logprob_token_ids: _neutral(list[int]) = None
    logit_bias: _neutral(dict[str, float], {}) = None
    allowed_token_ids: _neutral(list[int]) = None
    bad_words: _neutral(list[str], []) = None
    structured_outputs: _neutral(dict[str, Any]) = None
    watermarking: _neutral(dict[str, Any]) = None
    extra_args: _neutral(dict[str, Any]) = None
    thinking_token_budget: _neutral(int) = None
    repetition_detection: _neutral(dict[str, Any]) = None
    trace_decode_token_ids: _neutral(list[int]) = None
    routed_experts_prompt_start: _neutral(int, 0) = None
    output_text_buffer_length: _neutral(int, 0) = None
    # Accepted whatever their value: they change nothing of a token-id answer.
    seed: _ignored(int) = None
    detokenize: _ignored(bool) = None
    skip_special_tokens: _ignored(bool) = None
    spaces_between_special_tokens: _ignored(bool) = None
    include_stop_str_in_output: _ignored(bool) = None
    flat_logprobs: _ignored(bool) = None
    skip_clone: _ignored(bool) = None
    skip_reading_prefix_cache: _ignored(bool) = None
    output_kind: _ignored(int) = None
    stream_interval: _ignored(int) = None

    @model_validator(mode="before")
    @classmethod
    def _only_scoring(cls, body: Any) -> Any:
        _closed(cls, body, f"{SAMPLING}.")
        return body


class GenerateBody(WireModel):
    """`POST /inference/v1/generate` as this server serves it (vLLM's `GenerateRequest`, scoring)."""

    # Served, checked in this order (a body wrong twice is told its first fault).
    model: Annotated[str | None, checked(_string, str | None)] = None
    token_ids: Annotated[list[int], checked(_token_ids, list[Int32])] = required("the prompt's token ids")
    sampling_params: Annotated[SamplingBody, checked(_sampling, SamplingBody)] = required("what to score")
    request_id: Annotated[str | None, checked(_string, str | None)] = None
    cache_salt: Annotated[str | None, checked(_cache_salt, str | None)] = None
    return_token_ids: Annotated[bool, checked(_flag, bool | None)] = False
    # Accepted at their neutral value only.
    output_mode: _neutral(str, "tokens") = None
    stream: _neutral(bool, False) = None
    stream_options: _neutral(dict[str, Any]) = None
    priority: _neutral(int, 0) = None
    features: _neutral(dict[str, Any]) = None
    content_parts: _neutral(list[dict[str, Any]], []) = None
    kv_transfer_params: _neutral(dict[str, Any]) = None
    ec_transfer_params: _neutral(dict[str, Any]) = None
    # Accepted whatever their value: metadata of /render that scoring does not read.
    token_offsets: _ignored(list[list[int]]) = None
    reasoning_ended: _ignored(bool) = None
    reasoning_parser_kwargs: _ignored(dict[str, Any]) = None

    _rows: int = PrivateAttr(default=0)

    @model_validator(mode="before")
    @classmethod
    def _only_scoring(cls, body: Any) -> Any:
        _closed(cls, body, "")
        return body

    @model_validator(mode="after")
    def _one_row_per_scored_position(self) -> GenerateBody:
        """vLLM's rule: row i scores prompt token start + i + 1, so the rows are prompt_len - 1 - start."""
        sampling = self.sampling_params
        ids = sampling.prompt_logprob_token_ids
        if ids is not None:
            want = max(len(self.token_ids) - 1 - self.start, 0)
            if ids.shape[0] != want:
                raise invalid(f"{SAMPLING}.prompt_logprob_token_ids",
                              f"has {ids.shape[0]} rows, but the prompt has {want} scored rows "
                              "(prompt_len - 1 - prompt_logprob_start)")
        return self

    @property
    def start(self) -> int:
        """The first scored row of prompt_logprob_token_ids (vLLM's row numbering)."""
        return self.sampling_params.prompt_logprob_start or 0
