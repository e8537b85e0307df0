"""The scoring subset of vLLM's OpenAI-compatible server, on proctor's HTTP port: its request.

Trainers pick a teacher service by what they already speak: TRL's `VLLMClient` (its
`get_sequence_logprobs`, behind the server-distillation trainers), the `openai` package and
hand-written clients of `vllm serve` score token sequences with `GET /health`, `GET /v1/models`
and `POST /v1/completions` carrying token-id prompts, `max_tokens: 1` and `prompt_logprobs: K`.
Answering those three lets them use a proctor teacher unchanged, `model` being the teacher key,
and every prompt goes through the same `ScoringService.score` as `/v1/score` (routing,
validation, admission, metrics, auth by the app's middleware).

Only what scoring means is served, each field exactly as vLLM answers it (the answer is built
by `Responses.completion`): `choices[i].prompt_logprobs` is `null` at position 0, then per
position a dict `{"<token id>": {"logprob", "rank", "decoded_token"}}` with the top-K (ranks
1..K) and the actual token at its true rank (the engine's), `choices[i].prompt_token_ids`,
`usage`. Evaluation harnesses (lm-eval's `local-completions`, lighteval) ask instead for
OpenAI's `echo` + `logprobs: N`: `choices[i].logprobs` then holds `tokens`, `token_logprobs`
(null first), `top_logprobs` (null first, then token text -> log-prob) and `text_offset` over the
prompt, and with `max_tokens: 1` at `temperature: 0` the teacher's greedy next token is appended
to them and to `text`, as vLLM appends it (`completion_json.CompletionForm`). Temperature 0 is
greedy with raw log-probs, as vLLM takes it; any other temperature divides the teacher's logits
before the log-softmax (the service refuses T != 1 on an engine that cannot) and generates
nothing. Anything else of the completions API (sampling controls, `max_tokens` > 1, streaming,
`n` > 1, a sampled token, text prompts for a teacher without a tokenizer) is refused with a 400
naming the parameter, never half-served; errors take OpenAI's shape (`http.errors.openai_error`).

This module is that contract's request: `CompletionBody`, one pydantic model whose fields are
the parameters served, those accepted at their neutral value only, and those ignored, so that
its validation and its OpenAPI schema are the same list. `completions_serving` serves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import PrivateAttr, ValidationInfo, model_validator

from proctor.server.common.errors import invalid
from proctor.server.front.completion_json import CompletionForm
from proctor.server.front.http.models import (
    ABSENT,
    Int32,
    WireModel,
    checked,
    json_temperature,
    refuse_sampled_token,
    required,
)
from proctor.server.front.ids import int32_ids

_NOT_SCORING = "is not supported: this server scores prompts (prompt_logprobs) and generates nothing"


def is_greedy(temperature: float | None) -> bool:
    """Whether a generating surface's temperature (vLLM's, SGLang's, OpenAI's) asks for greedy
    decoding: 0 there means greedy, and those servers' prompt log-probs are then the raw ones, so
    0 is taken as "score at 1, generate greedily"; any other value is the scoring temperature,
    checked by `front.validation` like every other (`scoring_temperature`)."""
    return temperature == 0.0


def scoring_temperature(temperature: float | None) -> float | None:
    """The temperature to score at for a generating surface's value: none (1) for greedy."""
    return None if temperature is None or is_greedy(temperature) else temperature


@dataclass(frozen=True)
class Neutral:
    """A completions parameter that means nothing to scoring, accepted at its neutral values only
    (what the `openai` package or vLLM would default it to)."""

    values: tuple[Any, ...]


def _as_given(value: Any) -> Any:
    return value


def _neutral(wire_type: Any, *values: Any) -> Any:
    """A neutral parameter's annotation: documented as `wire_type`, checked against `values`."""
    return Annotated[wire_type | None, checked(_as_given, wire_type | None), Neutral(values)]


def _ignored(wire_type: Any) -> Any:
    """A parameter accepted whatever its value: it changes nothing about a prompt's scores."""
    return Annotated[wire_type | None, checked(_as_given, wire_type | None)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _model(value: Any) -> str:
    if value is not None and not isinstance(value, str):
        raise invalid("model", "must be a string (a teacher key from /v1/models)")
    return value or ""


def _prompt_given(value: Any) -> Any:
    if value is ABSENT:
        raise invalid("prompt", "is required")
    return value  # its forms are checked last (`CompletionBody._prompt_forms`)


def _echo(value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid("echo", "must be a boolean")
    return value


def _max_tokens(value: Any, info: ValidationInfo) -> int:
    value = None if value is ABSENT else value
    if not _is_int(value) or value not in ((0, 1) if info.data.get("echo") else (1,)):
        raise invalid("max_tokens", f"is {value!r}; this server scores prompts and generates nothing: "
                      "send max_tokens 1 (or 0 with echo)")
    return value


def _count(field: str) -> Any:
    """A log-prob count (`prompt_logprobs` K, `logprobs` N): absent, null or an integer >= 0."""

    def check(value: Any) -> int | None:
        if value is None:
            return None
        if not _is_int(value) or value < 0:
            raise invalid(field, f"is {value!r}; it must be an integer >= 0")
        return value

    return check


def _ids(prompt: list, field: str) -> list[int]:
    if not prompt:
        raise invalid(field, "is empty")
    int32_ids(field, prompt)
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


_Prompt = list[Int32] | list[list[Int32]] | str | list[str]


class CompletionBody(WireModel):
    """`POST /v1/completions` as this server serves it: prompts scored, nothing generated
    (`max_tokens` 1, or 0 with `echo`), `prompt_logprobs` the top-K per position."""

    # Served, checked in this order (a body wrong twice is told its first fault).
    model: Annotated[str, checked(_model, str | None)] = ""
    prompt: Annotated[Any, checked(_prompt_given, _Prompt)] = required("token ids, lists of them, or text")
    echo: Annotated[bool, checked(_echo, bool)] = False
    max_tokens: Annotated[int, checked(_max_tokens, int)] = required("1 (or 0 with echo)")
    prompt_logprobs: Annotated[int | None, checked(_count("prompt_logprobs"), int | None)] = None
    logprobs: Annotated[int | None, checked(_count("logprobs"), int | None)] = None
    # 0: greedy, raw log-probs (`is_greedy`); else the temperature scores are divided by.
    temperature: Annotated[float | None, checked(json_temperature, float | None)] = None
    cache_salt: str | None = None  # vLLM's: scopes prompt reuse (ScoreRequest.cache_salt)
    # Accepted at their neutral value only.
    n: _neutral(int, 1) = None
    best_of: _neutral(int, 1) = None
    stream: _neutral(bool, False) = None
    stream_options: _neutral(dict[str, Any]) = None
    top_p: _neutral(float, 1, 1.0) = None
    top_k: _neutral(int, 0, -1) = None
    min_p: _neutral(float, 0, 0.0) = None
    presence_penalty: _neutral(float, 0, 0.0) = None
    frequency_penalty: _neutral(float, 0, 0.0) = None
    repetition_penalty: _neutral(float, 1, 1.0) = None
    stop: _neutral(list[str] | str, (), []) = None
    stop_token_ids: _neutral(list[int], (), []) = None
    logit_bias: _neutral(dict[str, float], {}) = None
    suffix: _neutral(str, "") = None
    min_tokens: _neutral(int, 0) = None
    # Accepted whatever their value.
    user: _ignored(str) = None
    seed: _ignored(int) = None
    add_special_tokens: _ignored(bool) = None
    skip_special_tokens: _ignored(bool) = None
    request_id: _ignored(str) = None
    return_tokens_as_token_ids: _ignored(bool) = None
    spaces_between_special_tokens: _ignored(bool) = None

    _parsed: list[list[int] | str] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _only_scoring(cls, body: Any) -> Any:
        """Every parameter known, each neutral one at its neutral value, in the body's order."""
        for key, value in body.items():
            field = cls.model_fields.get(key)
            if field is None:
                raise invalid(key, _NOT_SCORING)
            neutral = next((item for item in field.metadata if isinstance(item, Neutral)), None)
            if neutral is not None and value is not None and value not in neutral.values:
                raise invalid(key, f"is {value!r}; only its neutral value is served here (scoring: "
                              "prompt_logprobs with max_tokens 1, or 0 with echo)")
        return body

    @model_validator(mode="after")
    def _prompt_forms(self) -> CompletionBody:
        generates = self.max_tokens == 1 and is_greedy(self.temperature)
        if self.max_tokens == 1 and self.logprobs is not None and not generates:
            refuse_sampled_token(self.temperature)
        if self.prompt_logprobs is None and self.logprobs is None and not generates:
            raise invalid("prompt_logprobs", "is required: send prompt_logprobs K, logprobs N with echo, or "
                          "temperature 0 for the greedy next token")
        self._parsed = _prompts(self.prompt)
        return self

    @property
    def prompts(self) -> list[list[int] | str]:
        """The prompts, each token ids or text."""
        return self._parsed

    @property
    def form(self) -> CompletionForm:
        """What each choice of the answer holds (`completion_json.CompletionForm`)."""
        prompt_topk = self.prompt_logprobs if self.prompt_logprobs is not None else (
            self.logprobs if self.echo else None)  # vLLM's rule: echo + logprobs scores the prompt at N
        return CompletionForm(prompt_topk=prompt_topk, logprobs=self.logprobs, echo=self.echo,
                              generates=self.max_tokens == 1 and is_greedy(self.temperature))

    @property
    def topk(self) -> int:
        return self.form.engine_topk

    @property
    def scoring_temperature(self) -> float | None:
        return scoring_temperature(self.temperature)
