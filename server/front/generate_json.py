"""SGLang's `/generate` answer, written column-wise from a scored request's rows.

SGLang answers each prompt as `{"text", "output_ids", "meta_info"}`, its log-probs as entries
`[logprob, token_id, text-or-null]`: per prompt position from `logprob_start_len`
(`input_token_logprobs`, the first entry's log-prob null), per position the top-k
(`input_top_logprobs`) or the log-probs of the asked ids (`input_token_ids_logprobs`), the first
position null; the same about what follows the prompt (`output_*`); and with
`return_hidden_states` the last layer's activations, one list per position. An answer with
top-64 over thousands of positions holds hundreds of thousands of entries, so an entry is pieces
in an object array, joined once (`completion_json`'s technique): `[` and the log-prob's text (what
`json.dumps` writes of the float32 widened, as SGLang's `tolist()` gives it), then `,<id>,` and
`<text>]` from a table made once per id (`EntryText`). No Python runs per entry.

`Planned` (what a prompt's answer shows and where its rows are) is filled by the SGLang surface
(`http.sglang_compat.plan`); `Responses` builds the answer and counts its bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from proctor.proto import scoring_pb2
from proctor.server.front.completion_json import float_texts
from proctor.server.front.token_text import TokenText

if TYPE_CHECKING:
    from proctor.server.front.service import ScoredRequest


class EntryText(TokenText):
    """Token id -> the pieces of an SGLang entry after its log-prob: `,<id>,` and `<text>]` (each
    id decoded alone, as SGLang's `return_text_in_logprobs` gives it)."""

    def decode_alone(self, token: int) -> str:
        tokenizer = self._tokenizer
        return tokenizer.decode([token]) if tokenizer is not None else ""

    def key_piece(self, token: int) -> str:
        return f",{token},"

    def tail_piece(self, text: str) -> str:
        return json.dumps(text) + "]"


@dataclass(frozen=True)
class Planned:
    """One prompt as proctor scores it, and what SGLang's answer to it shows."""

    message: scoring_pb2.ScoreRequest
    rid: str
    ids: list[int]  # the prompt's T ids (the message may hold one placeholder more)
    start: int | None  # the effective logprob_start_len (None: log-probs not asked)
    next_row: bool  # row T, about what follows the prompt, was scored
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    hidden_states: bool | str  # False, True (every position) or "last"
    max_new_tokens: int


@dataclass(frozen=True)
class Finish:
    """What a prompt generated: `text`, `output_ids` and `finish_reason` as SGLang reports them."""

    text: str
    output_ids: list[int]
    finish_reason: dict[str, Any]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _entries(values: np.ndarray, ids: np.ndarray, text: EntryText | None) -> np.ndarray:
    """[..., 4] pieces of the entries `[value, id, text]` (the first piece left for the caller)."""
    pieces = np.empty((*ids.shape, 4), dtype=object)
    pieces[..., 1] = float_texts(values.astype(np.float32, copy=False))
    if text is None:
        pieces[..., 2] = _plain_tails(ids)
        pieces[..., 3] = ""
    else:
        pieces[..., 2], pieces[..., 3] = text.pieces(ids.astype(np.int64))
    return pieces


def _plain_tails(ids: np.ndarray) -> np.ndarray:
    """`,<id>,null]` per id, without a tokenizer's text (one string made per distinct id)."""
    unique, inverse = np.unique(ids.astype(np.int64).ravel(), return_inverse=True)
    table = np.asarray([f",{token},null]" for token in unique.tolist()] or [""], dtype=object)
    return table[inverse].reshape(ids.shape)


def entry_list(values: np.ndarray, ids: np.ndarray, text: EntryText | None) -> str:
    """`[[v,id,t],...]` for the entries of one position ([K] arrays), or, given [R, K], the R
    positions' lists joined by commas (without the enclosing list)."""
    if values.ndim == 1:
        values, ids = values[None], ids[None]
    rows, width = ids.shape
    if not rows:
        return ""
    if not width:
        return ",".join(["[]"] * rows)
    pieces = _entries(values, ids, text)
    pieces[:, :, 0] = ",["
    pieces[:, 0, 0] = "],[["
    return "".join(pieces.ravel().tolist())[2:] + "]"


def _position_entries(values: np.ndarray, ids: np.ndarray, text: EntryText | None) -> str:
    """`[v,id,t],[v,id,t],...` for one entry per position ([R] arrays)."""
    if not ids.shape[0]:
        return ""
    pieces = _entries(values, ids, text)
    pieces[:, 0] = ",["
    return "".join(pieces.ravel().tolist())[1:]


def _first_entry(token: int, text: EntryText | None) -> str:
    """The entry of the position logprob_start_len: SGLang gives no log-prob for it."""
    if text is None:
        return f"[null,{token},null]"
    key, tail = text.pieces(np.asarray([token], dtype=np.int64))
    return "[null" + key[0] + tail[0]


def _numbers(values: np.ndarray) -> str:
    """[R, H] numbers as `[a,b,...],[...]` (what `json.dumps` writes of their float32 widening)."""
    rows, width = values.shape
    if not rows:
        return ""
    pieces = np.empty((rows, width, 2), dtype=object)
    pieces[:, :, 0] = ","
    pieces[:, 0, 0] = "],["
    pieces[:, :, 1] = float_texts(values.astype(np.float32, copy=False))
    return "".join(pieces.ravel().tolist())[2:] + "]"


def _logprob_fields(plan: Planned, scored: ScoredRequest, text: EntryText | None) -> str:
    """The log-prob keys of meta_info, in SGLang's order."""
    result = scored.result
    first = result.first_row
    ids = np.asarray(plan.ids, dtype=np.int64)
    count, start = ids.shape[0], plan.start
    at = (start + 1 - first, count - first)  # prompt rows start+1..T-1 in the answer's rows
    tail = count - first  # row T's index, when scored
    out = []
    if start < count:
        prompt = _position_entries(result.logprobs.numpy()[at[0]:at[1]], ids[start + 1:], text)
        out.append(f'"input_token_logprobs":[{_first_entry(int(ids[start]), text)}{"," if prompt else ""}{prompt}]')
    else:
        out.append('"input_token_logprobs":[]')
    outputs = ""
    if plan.max_new_tokens:
        outputs = _position_entries(result.topk_logprobs.numpy()[tail:tail + 1, 0],
                                    result.topk_ids.numpy()[tail:tail + 1, 0], text)
    out.append(f'"output_token_logprobs":[{outputs}],"output_token_logprobs_length":{int(plan.max_new_tokens)}')
    k = plan.top_logprobs_num
    if k:
        top_ids, top_values = result.topk_ids.numpy()[:, :k], result.topk_logprobs.numpy()[:, :k]
        out.append(_null_first("input_top_logprobs", start, count,
                               entry_list(top_values[at[0]:at[1]], top_ids[at[0]:at[1]], text)))
        out.append(f'"output_top_logprobs":[{entry_list(top_values[tail], top_ids[tail], text)}]')
    if plan.token_ids_logprob is not None:
        wanted = len(plan.token_ids_logprob)
        given = np.broadcast_to(np.asarray(plan.token_ids_logprob, dtype=np.int64), (result.score_logprobs.shape[0], wanted))
        values = result.score_logprobs.numpy()[:, :wanted]
        out.append(_null_first("input_token_ids_logprobs", start, count,
                               entry_list(values[at[0]:at[1]], given[at[0]:at[1]], text)))
        out.append(f'"output_token_ids_logprobs":[{entry_list(values[tail], given[tail], text)}]')
    return ",".join(out)


def _null_first(name: str, start: int, count: int, rows: str) -> str:
    if start >= count:
        return f'"{name}":[]'
    return f'"{name}":[null{"," if rows else ""}{rows}]'


def _hidden_field(plan: Planned, scored: ScoredRequest) -> str:
    """SGLang's `hidden_states`: the prefill's positions 0..T-1 as one list (rows 1..T), or with
    "last" the last position's alone (row T)."""
    hidden = scored.result.hidden_states.float().numpy()
    first = scored.result.first_row
    count = len(plan.ids)
    if plan.hidden_states == "last":
        return f'"hidden_states":[{_numbers(hidden[count - first:count - first + 1])}]'
    return f'"hidden_states":[[{_numbers(hidden[1 - first:count + 1 - first])}]]'


def generate_item_json(plan: Planned, scored: ScoredRequest, finish: Finish, *, text: EntryText | None,
                       latency: float) -> str:
    """One prompt's answer as SGLang writes it."""
    head = {"id": plan.rid, "finish_reason": finish.finish_reason, "prompt_tokens": len(plan.ids),
            "weight_version": "default", "num_retractions": 0}
    meta = [_dumps(head)[:-1]]
    if plan.start is not None:
        meta.append(_logprob_fields(plan, scored, text))
    counts = {"reasoning_tokens": 0, "completion_tokens": len(finish.output_ids),
              "cached_tokens": scored.result.prompt_reused_tokens or 0}
    meta.append(_dumps(counts)[1:-1])
    if plan.hidden_states:
        meta.append(_hidden_field(plan, scored))
    meta.append(f'"e2e_latency":{latency!r}}}')
    return f'{{"text":{_dumps(finish.text)},"output_ids":{_dumps(finish.output_ids)},"meta_info":{",".join(meta)}}}'


def generate_answer(plans: Sequence[Planned], scored: Sequence[ScoredRequest], finishes: Sequence[Finish], *,
                    batch: bool, text: EntryText | None, latency: float) -> bytes:
    """The whole `/generate` answer: one prompt's object, or a batch's list of them."""
    items = [generate_item_json(plan, score, finish, text=text, latency=latency)
             for plan, score, finish in zip(plans, scored, finishes, strict=True)]
    return (f"[{','.join(items)}]" if batch else items[0]).encode()
