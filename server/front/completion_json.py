"""vLLM's `prompt_logprobs` JSON, assembled from per-column string pieces in one join.

A `/v1/completions` answer with `prompt_logprobs=K` holds (K + 1) entries per token
(`"<id>":{"logprob":x,"rank":r,"decoded_token":"..."}`): building a dict per entry and
`json.dumps` of the whole was the endpoint's main cost, and so was, after it, formatting every
field with numpy's string ufuncs (their float formatting and the per-operation copies of a
growing StringDType line cost ~2 µs an entry, 140 µs a scored top-64 token). Here an entry is
four pieces in an object array: the id's key (`"<id>":{"logprob":`) and its tail
(`,"decoded_token":"..."}`) from a table built once per id, the log-prob as Python's float repr
(what `json.dumps` writes), and the rank's piece; the pieces of every kept entry are joined
once. No Python bytecode runs per entry. The text equals `json.dumps` of vLLM's dict form (the
actual token first; a top-K entry equal to it is left out, as a dict keeps the first key).

OpenAI's `logprobs` object (the `echo` + `logprobs` form evaluation harnesses send) is written the
same way (`openai_logprobs_json`): per step vLLM's dict of the actual token and the top-K cut to
N + 1 items, keyed by text; texts come from `token_text`. `completion_answer` is the whole
`/v1/completions` answer around those lists, the greedy next token appended where the call
generates one (`CompletionForm`); `Responses` builds it (and counts its bytes) like every other
answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from proctor.server.front.token_text import REPLACEMENT, TokenText, vllm_token_texts

if TYPE_CHECKING:
    from proctor.server.front.service import ScoredRequest

# Rows formatted per join: one join of ~5 pieces an entry holds the GIL for a few ms at most,
# so an answer built on a worker thread leaves the event loop its turns.
_ROWS_PER_PIECE = 256


def float_texts(values: np.ndarray) -> np.ndarray:
    """float32 values as json.dumps writes their float64 widening (an object array of str)."""
    wide = values.astype(np.float64).ravel()
    out = np.empty(wide.shape[0], dtype=object)
    out[:] = list(map(float.__repr__, wide.tolist()))
    odd = np.flatnonzero(~np.isfinite(wide))
    for index in odd.tolist():  # JSON's spellings (json.dumps' allow_nan), rare: masked entries
        value = wide[index]
        out[index] = "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return out.reshape(values.shape)


# vLLM's floor for a log-prob in its JSON answers: `prompt_logprobs` entries of -inf are written as
# this (`clamp_prompt_logprobs`), and OpenAI's `logprobs` values are held at or above it.
LOGPROB_FLOOR = -9999.0


def prompt_logprobs_json(ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray | None,
                         topk_ids: np.ndarray | None, topk_logprobs: np.ndarray | None, text: TokenText) -> str:
    """One prompt's `prompt_logprobs` list as JSON: `null`, then rows 1..T-1 (`ids` [T], the
    rest per row [T-1] / [T-1, K])."""
    actual = np.asarray(ids)[1:].astype(np.int64)
    rows = actual.shape[0]
    if not rows:
        return "[null]"
    k = 0 if topk_ids is None else topk_ids.shape[1]
    tokens = np.empty((rows, k + 1), dtype=np.int64)
    tokens[:, 0] = actual
    values = np.empty((rows, k + 1), dtype=np.float32)
    values[:, 0] = logprobs
    keep = np.ones((rows, k + 1), dtype=bool)
    if k:
        tokens[:, 1:] = topk_ids
        values[:, 1:] = topk_logprobs
    values[np.isneginf(values)] = LOGPROB_FLOOR  # vLLM's clamp_prompt_logprobs: -inf only
    if k:
        hit = topk_ids == actual[:, None]
        rank = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, ranks if ranks is not None else k + 1)
        keep[:, 1:] = ~hit
    else:
        rank = ranks if ranks is not None else np.ones(rows, dtype=np.int64)
    rank_pieces = np.empty((rows, k + 1), dtype=object)
    rank_pieces[:, 1:] = np.asarray([f',"rank":{place}' for place in range(1, k + 1)], dtype=object)
    rank_pieces[:, 0] = [f',"rank":{r}' for r in np.asarray(rank).astype(np.int64).tolist()]
    out = []
    for start in range(0, rows, _ROWS_PER_PIECE):
        stop = min(rows, start + _ROWS_PER_PIECE)
        keys, tails = text.pieces(tokens[start:stop])
        _, quoted, split = vllm_token_texts(tokens[start:stop], ids, text, first_position=start + 1)
        if split.any():  # a character split across tokens: its decoded_token read in context
            tails = np.where(split, ',"decoded_token":' + quoted + "}", tails)
        entry = np.empty((stop - start, k + 1, 5), dtype=object)
        entry[:, :, 0] = ","
        entry[:, 0, 0] = "},{"
        entry[:, :, 1] = keys
        entry[:, :, 2] = float_texts(values[start:stop])
        entry[:, :, 3] = rank_pieces[start:stop]
        entry[:, :, 4] = tails
        out.append("".join(entry[keep[start:stop]].ravel().tolist()))
    return "[null," + "".join(out)[2:] + "}]"




@dataclass(frozen=True)
class CompletionForm:
    """What a `/v1/completions` call asks of every choice: `prompt_topk`, the K of its
    `prompt_logprobs` (None: null); `logprobs`, the N of OpenAI's `logprobs` object (None: null);
    `echo`, the prompt in `text` and in `logprobs`; `generates`, the teacher's greedy next token
    appended (max_tokens 1 at temperature 0). The engine scores one extra row for it, the
    distribution after the prompt (`CompletionForm.scored_ids`)."""

    prompt_topk: int | None
    logprobs: int | None
    echo: bool
    generates: bool

    @property
    def engine_topk(self) -> int:
        """The top-K the engine is asked for: the widest any part of the answer reads."""
        return max(self.prompt_topk or 0, self.logprobs or 0, 1 if self.generates else 0)

    def scored_ids(self, prompt: list[int]) -> list[int]:
        """The ids the engine scores: the prompt, and with `generates` one more (any id: only the
        distribution before it is read, and a causal model's earlier rows do not see it)."""
        return [*prompt, prompt[-1]] if self.generates else prompt


@dataclass(frozen=True)
class _Steps:
    """Log-prob steps as OpenAI's `logprobs` reads them: per row the actual token, its log-prob,
    and the candidates of vLLM's step dict (actual first, then the top-K), all [R] / [R, 1 + K]."""

    actual: np.ndarray
    values: np.ndarray
    candidates: np.ndarray
    candidate_values: np.ndarray
    keep: np.ndarray


def _steps(actual: np.ndarray, logprobs: np.ndarray, topk_ids: np.ndarray, topk_logprobs: np.ndarray,
           n: int) -> _Steps:
    """vLLM's step dicts cut to OpenAI's `top_logprobs`: the actual token, then the top-K without
    it (a dict by id keeps it once), the first N + 1 items kept."""
    rows, k = topk_ids.shape
    candidates = np.empty((rows, k + 1), dtype=np.int64)
    candidates[:, 0], candidates[:, 1:] = actual, topk_ids
    values = np.empty((rows, k + 1), dtype=np.float32)
    values[:, 0], values[:, 1:] = logprobs, topk_logprobs
    keep = np.ones((rows, k + 1), dtype=bool)
    keep[:, 1:] = topk_ids != actual[:, None]
    keep &= np.cumsum(keep, axis=1) <= n + 1
    return _Steps(actual, logprobs, candidates, values, keep)


def _clamped_texts(values: np.ndarray) -> np.ndarray:
    return float_texts(np.maximum(values.astype(np.float32), np.float32(LOGPROB_FLOOR)))


def _top_dicts(steps: _Steps, ids: np.ndarray | None, text: TokenText) -> tuple[str, np.ndarray]:
    """Every step's `top_logprobs` dict as JSON text, comma-joined, and the actual tokens' texts.
    The keys are the candidates' texts, so two ids of one text are one key, at its first place with
    the last value (a dict's rule): such rows (rare: found by comparing the texts' numbers, not the
    strings) are built as dicts; every other entry is pieces in one join."""
    texts, quoted, split = vllm_token_texts(steps.candidates, ids, text)
    codes = text.codes(steps.candidates)
    for row, col in zip(*np.nonzero(split), strict=True):  # texts read in context: numbered one by one
        codes[row, col] = text.code_of(texts[row, col])
    grid = np.where(steps.keep, codes, -1 - np.arange(codes.shape[1]))  # dropped entries never clash
    ordered = np.sort(grid, axis=1)
    clash = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1) if codes.shape[1] > 1 else np.zeros(len(codes), bool)
    pieces = np.empty((*codes.shape, 4), dtype=object)
    pieces[:, :, 0] = ","
    pieces[:, 0, 0] = "},{"  # the actual token, always kept, opens its row's dict
    pieces[:, :, 1] = quoted
    pieces[:, :, 2] = ":"
    pieces[:, :, 3] = _clamped_texts(steps.candidate_values)
    keep = steps.keep.copy()
    for row in np.flatnonzero(clash).tolist():
        merged = {str(t): max(float(v), LOGPROB_FLOOR)
                  for t, v in zip(texts[row][keep[row]], steps.candidate_values[row][keep[row]], strict=True)}
        pieces[row, 0, 1:] = [json.dumps(merged, separators=(",", ":"))[1:-1], "", ""]
        keep[row, 1:] = False
    joined = "".join(pieces[keep].ravel().tolist())
    return (joined[2:] + "}") if joined else "", texts[:, 0]


def openai_logprobs_json(first_text: str | None, prompt: _Steps | None, prompt_ids: np.ndarray | None,
                         generated: _Steps | None, text: TokenText) -> str:
    """OpenAI's completion `logprobs` object as vLLM writes it: `tokens`, `token_logprobs` and
    `top_logprobs` over the echoed prompt (its first token with no log-prob: null) and the
    generated token, and `text_offset`, each token's start in the text they spell."""
    tokens: list[str] = [] if first_text is None else [first_text]
    values: list[str] = [] if first_text is None else ["null"]
    tops: list[str] = [] if first_text is None else ["null"]
    for steps, ids in ((prompt, prompt_ids), (generated, None)):
        if steps is None:
            continue
        rows, actual_texts = _top_dicts(steps, ids, text)
        tokens += actual_texts.tolist()
        values += _clamped_texts(steps.values).tolist()
        tops += [rows] if rows else []
    offsets = np.concatenate([[0], np.cumsum([len(token) for token in tokens])[:-1]]).astype(np.int64) \
        if tokens else np.zeros(0, dtype=np.int64)
    return (f'{{"text_offset":{_dumps(offsets.tolist())},"token_logprobs":[{",".join(values)}],'
            f'"tokens":{json.dumps(tokens)},"top_logprobs":[{",".join(tops)}]}}')


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _rows(values: Any, stop: int) -> np.ndarray | None:
    """A result's first `stop` rows as numpy (None where the engine gave none)."""
    return None if values is None else values.numpy()[:stop]


def _generated_text(prompt: list[int], token: int, tokenizer: Any) -> str:
    """The text vLLM's detokenizer adds for a generated `token` after `prompt`: read in the
    prompt's last tokens' context, special tokens skipped (a completion's default), "" while a
    split character is unfinished (it is held back until its last byte)."""
    if tokenizer is None:
        return ""
    context = prompt[-6:]
    before = tokenizer.decode(context, skip_special_tokens=True)
    whole = tokenizer.decode([*context, token], skip_special_tokens=True)
    added = whole[len(before):] if whole.startswith(before) else whole
    return "" if added.endswith(REPLACEMENT) else added


def _choice(index: int, ids: list[int], score: ScoredRequest, form: CompletionForm, *, echo_text: str,
            tokenizer: Any, text: TokenText) -> str:
    """One choice of the answer, as vLLM writes it."""
    result, size = score.result, len(ids)
    prompt_rows = size - 1  # the result's rows 1..T-1; with `generates`, row T follows
    logprobs, ranks = _rows(result.logprobs, prompt_rows), _rows(result.ranks, prompt_rows)
    topk_ids, topk_lps = _rows(result.topk_ids, prompt_rows), _rows(result.topk_logprobs, prompt_rows)
    if topk_ids is None:  # no top-K asked of the engine (logprobs 0 on an echoed prompt)
        topk_ids, topk_lps = np.zeros((prompt_rows, 0), dtype=np.int64), np.zeros((prompt_rows, 0), dtype=np.float32)
    array = np.asarray(ids, dtype=np.int64)
    generated, gen_text, gen_steps = None, "", None
    if form.generates:
        top_ids, top_lps = result.topk_ids.numpy()[prompt_rows], result.topk_logprobs.numpy()[prompt_rows]
        generated = int(top_ids[0])
        gen_text = _generated_text(ids, generated, tokenizer)
        if form.logprobs is not None:
            n = form.logprobs
            gen_steps = _steps(top_ids[:1].astype(np.int64), top_lps[:1], top_ids[None, :n], top_lps[None, :n], n)
    prompt_json = "null"
    if form.prompt_topk is not None:
        k = form.prompt_topk
        prompt_json = prompt_logprobs_json(array, logprobs, ranks, topk_ids[:, :k] if k else None,
                                           topk_lps[:, :k] if k else None, text)
    logprobs_json = "null"
    if form.logprobs is not None:
        prompt_steps, first = None, None
        if form.echo:
            k = form.prompt_topk or 0
            prompt_steps = _steps(array[1:], logprobs, topk_ids[:, :k], topk_lps[:, :k], form.logprobs)
            first = tokenizer.decode(ids[0]) if tokenizer is not None else ""
        logprobs_json = openai_logprobs_json(first, prompt_steps, array, gen_steps, text)
    head = {"index": index, "text": (echo_text if form.echo else "") + gen_text}
    tail = {"finish_reason": "length", "stop_reason": None}
    return (f'{_dumps(head)[:-1]},"logprobs":{logprobs_json},{_dumps(tail)[1:-1]},'
            f'"prompt_logprobs":{prompt_json},"prompt_token_ids":{_dumps(ids)}}}')


def completion_answer(prompts: Sequence[list[int]], scored: Sequence[ScoredRequest], *, model: str,
                      form: CompletionForm, tokenizer: Any, text: TokenText) -> bytes:
    """The whole `/v1/completions` answer, serialised, as vLLM shapes it: per choice the prompt
    log-probs written column-wise (`prompt_logprobs_json`), OpenAI's `logprobs` (`openai_logprobs_json`)
    and the greedy token where the call generates one; the rest by `json.dumps`. With `echo` each
    choice's `text` starts with its prompt decoded (here too, so that a large answer's decoding is
    off the loop with the rest)."""
    choices = []
    for index, (ids, score) in enumerate(zip(prompts, scored, strict=True)):
        echo_text = tokenizer.decode(ids) if form.echo and tokenizer is not None else ""
        choices.append(_choice(index, ids, score, form, echo_text=echo_text, tokenizer=tokenizer, text=text))
    tokens = sum(len(ids) for ids in prompts)
    # vLLM always runs one decode step (max_tokens 0 with echo is max_tokens 1 inside, its token not
    # shown), and counts it: one completion token per prompt, whatever the answer shows.
    generated = len(prompts)
    top = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    usage = {"prompt_tokens": tokens, "total_tokens": tokens + generated, "completion_tokens": generated}
    return f'{_dumps(top)[:-1]},"choices":[{",".join(choices)}],"usage":{_dumps(usage)}}}'.encode()
