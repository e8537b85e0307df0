"""The scoring subset of SGLang's native `POST /generate`, on proctor's HTTP port: its request.

slime and miles (`--opd-type sglang`, their `on_policy_distillation` and `mopd` reward functions)
call their teacher as an SGLang server: `{"input_ids": [...], "sampling_params": {"temperature":
..., "max_new_tokens": 0, "skip_special_tokens": false}, "return_logprob": true,
"logprob_start_len": 0}` (with `image_data` for images), reading
`meta_info.input_token_logprobs[1:]`. Others add `top_logprobs_num`, `token_ids_logprob`,
`return_text_in_logprobs`, `return_hidden_states`, batched `input_ids` or `text`, or ask one
greedy token (`max_new_tokens` 1, `temperature` 0) and read `output_token_logprobs`.

Each prompt of a call becomes one `ScoreRequest` for the one `ScoringService` (routing,
validation, admission, metrics, auth stay the service's and the app's). What SGLang computes
and what proctor's rows are differ by one convention, stated once here (`plan`): SGLang's
position p of the prompt is proctor's row p (its log-prob given tokens < p); SGLang's answer for
what follows the prompt (the greedy token, `output_top_logprobs`, the hidden state of the last
position) is row T, got by scoring one placeholder token past the prompt.

Only what scoring means is served: `max_new_tokens` 0 (or 1 for the greedy token), `stream`
false, no sampling beyond greedy, no LoRA, session or grammar; each refused with a 400 naming
the field in SGLang's error shape (`http.errors.sglang_error`). With `max_new_tokens` 0 nothing
is sampled, so every sampling parameter is accepted and ignored, as SGLang ignores them (its
prompt log-probs are the raw log-softmax, whatever the temperature).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import PrivateAttr, model_validator

from proctor.proto import scoring_pb2
from proctor.server.common.errors import invalid
from proctor.server.front.generate_json import Planned
from proctor.server.front.http.models import WireModel, checked
from proctor.server.front.http.sglang_fields import NOT_SCORING, Sampling, images, is_int, sampling
from proctor.server.front.ids import extend_ids, int32_ids

# A placeholder scored past the prompt to get SGLang's answer about what follows it (row T).
NEXT_PLACEHOLDER = 0


def _any(value: Any) -> Any:
    return value


def _none_only(field: str) -> Any:
    def check(value: Any) -> None:
        if value not in (None, [], {}, ""):
            raise invalid(field, NOT_SCORING)
    return Annotated[Any, checked(check, Any)]


def _false_only(field: str) -> Any:
    def check(value: Any) -> bool:
        if value not in (None, False):
            raise invalid(field, f"is {value!r}; only false is served here ({NOT_SCORING.removeprefix('is ')})")
        return False
    return Annotated[bool, checked(check, bool | None)]


def _bool(field: str) -> Any:
    def check(value: Any) -> bool | None:
        if value is not None and not isinstance(value, bool):
            raise invalid(field, "must be a boolean")
        return value
    return Annotated[bool | None, checked(check, bool | None)]


def _per_item(field: str, value: Any, count: int, batch: bool) -> list[Any]:
    """A parameter given once or (in a batch) once per prompt, as SGLang normalises it."""
    if batch and isinstance(value, list):
        if len(value) != count:
            raise invalid(field, f"has {len(value)} values for a batch of {count} prompts")
        return value
    return [value] * count


# -- prompts ---------------------------------------------------------------------------------
def _ids(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise invalid(field, "must be a non-empty list of token ids")
    int32_ids(field, value)
    return value


def _prompts(text: Any, input_ids: Any) -> tuple[list[list[int] | str], bool]:
    """SGLang's prompt forms: `text` (a string or a batch of them) or `input_ids` (a list of ids
    or a batch of lists), exactly one of the two; the prompts and whether the call is a batch."""
    if (text is None) == (input_ids is None):
        raise invalid("input_ids", "exactly one of text and input_ids must be given (input_embeds is not served)")
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if not isinstance(text, list) or not text or not all(isinstance(item, str) for item in text):
            raise invalid("text", "must be a string or a non-empty list of strings")
        return list(text), True
    if not isinstance(input_ids, list) or not input_ids:
        raise invalid("input_ids", "must be a non-empty list of token ids, or a list of such lists")
    if isinstance(input_ids[0], list):
        return [_ids(item, f"input_ids[{index}]") for index, item in enumerate(input_ids)], True
    return [_ids(input_ids, "input_ids")], False


# -- the per-prompt asks ----------------------------------------------------------------------
def _logprob_start(value: Any, field: str) -> int:
    if value is None:
        return -1
    if not is_int(value) or value < -1:
        raise invalid(field, f"is {value!r}; it must be an integer >= -1 (-1: no prompt log-probs)")
    return value


def _top_num(value: Any, field: str) -> int:
    if value is None:
        return 0
    if not is_int(value) or value < 0:
        raise invalid(field, f"is {value!r}; it must be an integer >= 0")
    return value


def _hidden_mode(value: Any, field: str) -> bool | str:
    if value is None or value is False:
        return False
    if value is True or value == "last":
        return value
    raise invalid(field, f"is {value!r}; it must be true, false or \"last\"")


def _token_ids_logprob(value: Any, count: int, batch: bool) -> list[list[int] | None]:
    """SGLang's forms: one id, a list of ids (every prompt), or in a batch one list per prompt;
    empty means none."""
    if not value:
        return [None] * count
    if is_int(value):
        value = [value]
    if not isinstance(value, list):
        raise invalid("token_ids_logprob", "must be a list of token ids (or one list per prompt)")
    if isinstance(value[0], list):
        if not batch or len(value) != count:
            raise invalid("token_ids_logprob", f"a list of lists needs a batch of as many prompts ({count})")
        out = []
        for index, ids in enumerate(value):
            if not isinstance(ids, list):
                raise invalid(f"token_ids_logprob[{index}]", "must be a list of token ids")
            int32_ids(f"token_ids_logprob[{index}]", ids)
            out.append(ids or None)
        return out
    int32_ids("token_ids_logprob", value)
    return [value] * count


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a `/generate` call and what it asks."""

    rid: str
    prompt: list[int] | str
    sampling: Sampling
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    hidden_states: bool | str
    images: list[scoring_pb2.Media]
    cache_salt: str


def _rids(rid: Any, count: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{index}" for index in range(count)] if batch else [rid]
    if batch and isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
        if len(set(rid)) != count:
            raise invalid("rid", "has duplicate request ids")
        return rid
    raise invalid("rid", "must be a string (or one string per prompt of a batch)")


class GenerateBody(WireModel):
    """`POST /generate` as this server serves it: prompts scored (`max_new_tokens` 0), or one
    greedy token (`max_new_tokens` 1); log-probs over the prompt from `logprob_start_len`."""

    rid: Annotated[Any, checked(_any, str | list[str] | None)] = None
    text: Annotated[Any, checked(_any, str | list[str] | None)] = None
    input_ids: Annotated[Any, checked(_any, list[int] | list[list[int]] | None)] = None
    sampling_params: Annotated[Any, checked(_any, dict[str, Any] | list[dict[str, Any]] | None)] = None
    return_logprob: Annotated[Any, checked(_any, bool | list[bool] | None)] = None
    logprob_start_len: Annotated[Any, checked(_any, int | list[int] | None)] = None
    top_logprobs_num: Annotated[Any, checked(_any, int | list[int] | None)] = None
    token_ids_logprob: Annotated[Any, checked(_any, list[int] | list[list[int]] | None)] = None
    return_text_in_logprobs: _bool("return_text_in_logprobs") = None
    return_hidden_states: Annotated[Any, checked(_any, bool | str | list[bool | str] | None)] = None
    image_data: Annotated[Any, checked(_any, str | list[str] | list[list[str]] | None)] = None
    mm_processor_kwargs: Annotated[Any, checked(_any, dict[str, Any] | None)] = None
    cache_salt: Annotated[Any, checked(_any, str | list[str] | None)] = None
    stream: _false_only("stream") = None
    # Accepted whatever their value: they change nothing about a prompt's scores.
    log_metrics: Annotated[Any, checked(_any, Any)] = None
    modalities: Annotated[Any, checked(_any, Any)] = None
    priority: Annotated[Any, checked(_any, Any)] = None
    routed_dp_rank: Annotated[Any, checked(_any, Any)] = None
    data_parallel_rank: Annotated[Any, checked(_any, Any)] = None
    extra_key: Annotated[Any, checked(_any, Any)] = None
    custom_labels: Annotated[Any, checked(_any, Any)] = None
    no_logs: Annotated[Any, checked(_any, Any)] = None
    session_id: Annotated[Any, checked(_any, Any)] = None
    conversation_id: Annotated[Any, checked(_any, Any)] = None
    routing_key: Annotated[Any, checked(_any, Any)] = None
    # Accepted at their neutral value only.
    input_embeds: _none_only("input_embeds") = None
    video_data: _none_only("video_data") = None
    audio_data: _none_only("audio_data") = None
    lora_path: _none_only("lora_path") = None
    session_params: _none_only("session_params") = None
    custom_logit_processor: _none_only("custom_logit_processor") = None
    return_routed_experts: _false_only("return_routed_experts") = None
    return_entropy: _false_only("return_entropy") = None
    return_prompt_token_ids: _false_only("return_prompt_token_ids") = None
    return_sampling_mask: _false_only("return_sampling_mask") = None
    return_flat_raw_top_logprobs: _false_only("return_flat_raw_top_logprobs") = None
    background: _false_only("background") = None

    _items: list[GenerateItem] = PrivateAttr(default_factory=list)
    _batch: bool = PrivateAttr(default=False)

    @model_validator(mode="before")
    @classmethod
    def _only_scoring(cls, body: Any) -> Any:
        for key in body:
            if key not in cls.model_fields:
                raise invalid(key, NOT_SCORING)
        return body

    @model_validator(mode="after")
    def _normalised(self) -> GenerateBody:
        prompts, batch = _prompts(self.text, self.input_ids)
        count = len(prompts)
        rids = _rids(self.rid, count, batch)
        params = self.sampling_params
        if isinstance(params, list) and not batch:
            raise invalid("sampling_params", "must be an object for one prompt")
        samplings = [sampling(p, f"sampling_params[{i}]" if isinstance(params, list) else "sampling_params")
                     for i, p in enumerate(_per_item("sampling_params", params, count, batch))]
        wants = _per_item("return_logprob", self.return_logprob, count, batch)
        for index, want in enumerate(wants):
            if want is not None and not isinstance(want, bool):
                raise invalid("return_logprob", f"must be a boolean (prompt {index})")
        starts = [_logprob_start(v, "logprob_start_len")
                  for v in _per_item("logprob_start_len", self.logprob_start_len, count, batch)]
        tops = [_top_num(v, "top_logprobs_num") for v in _per_item("top_logprobs_num", self.top_logprobs_num, count, batch)]
        hidden = [_hidden_mode(v, "return_hidden_states")
                  for v in _per_item("return_hidden_states", self.return_hidden_states, count, batch)]
        salts = _per_item("cache_salt", self.cache_salt, count, batch)
        if not all(salt is None or isinstance(salt, str) for salt in salts):
            raise invalid("cache_salt", "must be a string (or one per prompt of a batch)")
        self._items = [
            GenerateItem(rid, prompt, samp, bool(want), start, top, ids, mode, images, salt or "")
            for rid, prompt, samp, want, start, top, ids, mode, images, salt in zip(
                rids, prompts, samplings, wants, starts, tops,
                _token_ids_logprob(self.token_ids_logprob, count, batch), hidden,
                images(self.image_data, count, batch), salts, strict=True)
        ]
        self._batch = batch
        return self

    @property
    def items(self) -> list[GenerateItem]:
        """The prompts of the call, each with what it asks."""
        return self._items

    @property
    def batch(self) -> bool:
        """Whether the answer is a list (the call gave a batch of prompts)."""
        return self._batch


def plan(item: GenerateItem, ids: list[int], *, teacher_key: str, mm_processor_kwargs: str) -> Planned:
    """The rows SGLang's answer needs, as one ScoreRequest: prompt rows start+1..T-1, and row T
    (a placeholder token scored past the prompt) when the answer says what follows the prompt."""
    count = len(ids)
    start = None
    if item.return_logprob:
        start = item.logprob_start_len
        if start == -1:  # SGLang: no prompt log-probs, except the last position's for token_ids_logprob
            start = count - 1 if item.token_ids_logprob is not None and item.sampling.max_new_tokens else count
        if start > count:
            raise invalid("logprob_start_len", f"is {start}, higher than the number of input tokens ({count}); "
                          "use a smaller logprob_start_len")
    asks_next = item.return_logprob and (item.top_logprobs_num > 0 or item.token_ids_logprob is not None)
    next_row = bool(item.sampling.max_new_tokens or item.hidden_states or asks_next or count < 2)
    total = count + next_row
    rows = []
    if start is not None and start + 1 <= count - 1:
        rows.append(start + 1)
    if item.hidden_states is True:
        rows.append(1)
    if next_row:
        rows.append(count)
    first_row = min(rows, default=total - 1)  # asked nothing: the last row's log-prob, unread (SGLang answers all the same)
    message = scoring_pb2.ScoreRequest(
        request_id=item.rid, teacher_key=teacher_key, prompt_length=first_row, logprobs=True,
        topk=max(item.top_logprobs_num if item.return_logprob else 0, item.sampling.max_new_tokens),
        hidden_states=bool(item.hidden_states), cache_salt=item.cache_salt, mm_processor_kwargs=mm_processor_kwargs)
    extend_ids(message.token_ids, ids)
    if next_row:
        message.token_ids.append(NEXT_PLACEHOLDER)
    message.images.extend(item.images)
    if item.return_logprob and item.token_ids_logprob is not None:
        wanted = np.asarray(item.token_ids_logprob, dtype="<i4")
        tiled = np.broadcast_to(wanted, (total - first_row, wanted.shape[0]))
        message.score_ids.CopyFrom(scoring_pb2.Tensor(dtype=scoring_pb2.INT32, shape=list(tiled.shape),
                                                      data=np.ascontiguousarray(tiled).tobytes()))
    return Planned(message, item.rid, ids, start, next_row, item.top_logprobs_num if item.return_logprob else 0,
                   item.token_ids_logprob if item.return_logprob else None, item.hidden_states,
                   item.sampling.max_new_tokens)
