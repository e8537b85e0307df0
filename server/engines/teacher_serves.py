"""What a teacher serves, as one rule over the `EngineInfo` its engine declares.

The front validates every request against it (`front.validation`: INVALID_ARGUMENT naming the
field) before a replica sees the request; an engine may also be handed a request that no front
checked (engine tests, a worker driven directly), so it asks the same rule (`request_problem`,
its answer a `RequestRejected`) rather than restating it. Each check returns `(field, reason)`
or None, the caller turning it into its own error: the message is written here only.

It lives with the engines, not the front, because both use it and the front imports the
engines, never the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence

from proctor.server.engines.base import EngineInfo, EngineRequest, RequestRejected

Problem = tuple[str, str] | None


def sequence_problem(info: EngineInfo, teacher: str, count: int) -> Problem:
    """A sequence longer than the teacher scores (vLLM keeps one slot for its prefill's output)."""
    if count <= info.max_sequence_tokens:
        return None
    spare = "" if info.max_sequence_tokens == info.max_model_len else (
        "; the engine keeps one of its max_model_len slots for the output token of the prefill")
    return "token_ids", (f"has {count} tokens, more than teacher {teacher!r} scores "
                         f"({info.max_sequence_tokens}: max_model_len {info.max_model_len}{spare})")


# Numbers a request body may hold beside its id lists: scalars (prompt_length, topk, temperature)
# and a processor's kwargs. Generous: what it bounds is millions of ids, not a dozen settings.
BODY_SCALAR_NUMBERS = 4096


def most_body_numbers(info: EngineInfo, *, sequences: int = 1, score_ids: bool = True) -> int:
    """The most numbers a JSON body of `sequences` sequences can hold and still be served by the
    teacher: per sequence its ids (`max_sequence_tokens`) and, for a `/v1/score` body (`score_ids`),
    an aligned request's teacher-prompt ids (as many) and up to `max_topk` score_ids on each row. A body with more is
    refused before it is parsed (`front.bounded_json`), whatever it asks."""
    length = info.max_sequence_tokens
    per_sequence = length + (length + length * info.max_topk if score_ids else 0)
    return sequences * per_sequence + BODY_SCALAR_NUMBERS


def outputs_problem(info: EngineInfo, teacher: str, *, topk: int, hidden_states: bool, hidden_form: str) -> Problem:
    """A top-k wider than served, hidden states (or a hidden form) the teacher does not give."""
    if topk > info.max_topk:
        return "topk", f"is {topk}; teacher {teacher!r} serves at most {info.max_topk}"
    if topk > info.vocab_size:
        return "topk", f"is {topk}; the vocabulary has {info.vocab_size} tokens"
    if hidden_states and "hidden_states" not in info.outputs:
        return "hidden_states", f"teacher {teacher!r} does not serve hidden states"
    if hidden_form and (hidden_form not in info.hidden_forms or not hidden_states):
        return "hidden_form", (f"{hidden_form!r} is not a form teacher {teacher!r} gives "
                               f"(it offers: {', '.join(info.hidden_forms) or 'none'}; the projected ones need "
                               "inference.hidden_projection_rank), or hidden_states is not asked")
    return None


def score_ids_problem(info: EngineInfo, teacher: str) -> Problem:
    """score_ids asked of a teacher that does not serve them."""
    if "score_ids" in info.outputs:
        return None
    return "score_ids", f"teacher {teacher!r} ({info.engine} engine) does not serve score_ids"


def media_problem(info: EngineInfo, teacher: str, kinds: Sequence[str]) -> Problem:
    """Media of a kind the teacher does not take (any kind, for a text-only teacher)."""
    for kind in kinds:
        if kind not in info.media:
            return kind, (f"teacher {teacher!r} ({info.engine} engine) is text-only and cannot use {kind}"
                          if not info.media else f"teacher {teacher!r} accepts {', '.join(info.media)}, not {kind}")
    return None


def request_problem(info: EngineInfo, request: EngineRequest) -> RequestRejected | None:
    """An engine's own check of a request by the same rule (`info.model` names the teacher, which
    an engine knows by its model only)."""
    teacher = info.model
    problem = (sequence_problem(info, teacher, request.num_tokens)
               or outputs_problem(info, teacher, topk=request.topk, hidden_states=request.hidden_states,
                                  hidden_form=request.hidden_form)
               or (score_ids_problem(info, teacher) if request.score_ids is not None else None)
               or media_problem(info, teacher, request.media.kinds() if request.media else ()))
    return None if problem is None else RequestRejected(*problem, request_id=request.request_id)
