"""Per-sequence teacher scores ⇄ the batch tensors trainers consume.

Proctor's rows: row i is about token i given tokens 0..i-1, rows first_row..T-1 sent.
verl's rows (`verl/experimental/teacher_loop/teacher_manager.py`, fed by
`verl/workers/rollout/vllm_rollout/utils.py::extract_prompt_logprobs`): one row per token,
row i is the distribution that predicts token i+1 (the logits at position i), the last row a
dummy of zeros; `_pad_teacher_outputs` then left-pads the prompt part to the batch's prompt
width and right-pads the response part to its response width (ids with the pad token,
log-probs with 0.0), and the agent loop concatenates sequences into
`teacher_ids` / `teacher_logprobs` of shape [B, prompt_width + response_width, K]. With
`topk = 0` (sampled-token losses) K is 1 and row i holds token i+1 and its log-prob.

Hidden states stay jagged: a nested tensor of each sequence's response rows, with the teacher
of every token, which is what the chunked full-vocabulary loss takes (`packed()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from proctor.client.client import TeacherScores


def _tokens(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)


def verl_rows(
    scores: TeacherScores, token_ids: Sequence[int] | torch.Tensor, *, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in verl's unpadded layout: (ids int32 [T, K'], log-probs float32 [T, K']).

    K' = topk, or 1 with topk = 0 (then ids are the sequence's own next tokens). Rows the
    server did not send (before first_row - 1, i.e. inside the prompt) and the last row are
    zeros, as verl's dummy row; trainers only read rows from the last prompt token on.
    """
    tokens = _tokens(token_ids)
    total = tokens.shape[0]
    if scores.num_tokens != total:
        raise ValueError(f"scores cover {scores.num_tokens} tokens but token_ids has {total}")
    width = topk if topk > 0 else 1
    ids = torch.zeros((total, width), dtype=torch.int32)
    logprobs = torch.zeros((total, width), dtype=torch.float32)
    rows = slice(scores.first_row - 1, total - 1)  # verl row i = proctor row i + 1
    if topk > 0:
        if scores.topk_ids is None or scores.topk_ids.shape[1] < topk:
            have = None if scores.topk_ids is None else scores.topk_ids.shape[1]
            raise ValueError(f"verl asks for top-{topk} but the scores carry top-{have}; score with topk={topk}")
        ids[rows] = scores.topk_ids[:, :topk].to(torch.int32)
        logprobs[rows] = scores.topk_logprobs[:, :topk].float()
    else:
        if scores.logprobs is None:
            raise ValueError("sampled-token rows need the teacher's logprobs; score with logprobs=True")
        ids[rows, 0] = tokens[scores.first_row :].to(torch.int32)
        logprobs[rows, 0] = scores.logprobs.float()
    return ids, logprobs


def pad_verl_rows(
    rows: torch.Tensor,
    *,
    prompt_length: int,
    prompt_width: int,
    response_width: int,
    value: float | int,
) -> torch.Tensor:
    """[T, K'] → [1, prompt_width + response_width, K']: prompt left-padded, response right-padded."""
    total = rows.shape[0]
    response_length = total - prompt_length
    if not 0 < prompt_length <= prompt_width or not 0 <= response_length <= response_width:
        raise ValueError(
            f"a sequence of {prompt_length} prompt + {response_length} response tokens does not fit "
            f"widths {prompt_width} + {response_width}"
        )
    out = torch.full((prompt_width + response_width, *rows.shape[1:]), value, dtype=rows.dtype)
    out[prompt_width - prompt_length : prompt_width + response_length] = rows
    return out.unsqueeze(0)


def verl_teacher_batch(
    scores: Sequence[TeacherScores],
    token_ids: Sequence[Sequence[int] | torch.Tensor],
    prompt_lengths: Sequence[int],
    *,
    prompt_width: int,
    response_width: int,
    topk: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """`teacher_ids` int32 and `teacher_logprobs` float32, both [B, prompt_width + response_width, K']."""
    if not len(scores) == len(token_ids) == len(prompt_lengths):
        raise ValueError("scores, token_ids and prompt_lengths must have one entry per sequence")
    ids_out, lps_out = [], []
    for score, tokens, prompt_length in zip(scores, token_ids, prompt_lengths, strict=True):
        ids, lps = verl_rows(score, tokens, topk=topk)
        layout = {"prompt_length": prompt_length, "prompt_width": prompt_width, "response_width": response_width}
        ids_out.append(pad_verl_rows(ids, value=pad_token_id, **layout))
        lps_out.append(pad_verl_rows(lps, value=0.0, **layout))
    return {"teacher_ids": torch.cat(ids_out, dim=0), "teacher_logprobs": torch.cat(lps_out, dim=0)}


@dataclass
class SequenceRows:
    """Rows first_row..T-1 of one sequence in proctor's convention, as read back from a batch."""

    first_row: int
    ids: torch.Tensor  # [R, K']
    logprobs: torch.Tensor  # [R, K']


def rows_from_verl_batch(
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    prompt_width: int,
    first_rows: Sequence[int] | None = None,
) -> list[SequenceRows]:
    """The inverse of `verl_teacher_batch`: each sequence's rows back in proctor's convention
    (first_row defaults to the prompt length, the rows a trainer scores)."""
    out = []
    for b, (prompt_length, response_length) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        first = prompt_length if first_rows is None else first_rows[b]
        total = prompt_length + response_length
        start = prompt_width - prompt_length  # column of token 0
        # proctor row j = verl row j - 1, at column start + j - 1
        cols = slice(start + first - 1, start + total - 1)
        out.append(SequenceRows(first, teacher_ids[b, cols].clone(), teacher_logprobs[b, cols].clone()))
    return out


def verl_hidden_rows(scores: TeacherScores) -> torch.Tensor:
    """Hidden states [T, H] in verl's row convention: row i produced the prediction of token
    i+1 (the activation at position i); rows the server did not send and the last are zeros."""
    if scores.hidden_states is None:
        raise ValueError("no hidden states in these scores; score with hidden_states=True")
    hidden = scores.hidden_states
    out = torch.zeros((scores.num_tokens, hidden.shape[1]), dtype=hidden.dtype)
    out[scores.first_row - 1 : scores.num_tokens - 1] = hidden
    return out


@dataclass
class HiddenStatesBatch:
    """Response-row hidden states of a batch, jagged, with the teacher of every token.

    `hidden_states`: nested (jagged) [B, R_b, H_max] (a teacher with a smaller hidden size is
    zero-padded on the right). `teacher_index`: nested [B, R_b] int64 into `teachers`.
    Row r of sequence b is the teacher state that predicts token first_rows[b] + r, so it pairs
    with the student's activation at position first_rows[b] + r - 1.
    """

    hidden_states: torch.Tensor
    teacher_index: torch.Tensor
    teachers: list[str]
    hidden_sizes: dict[str, int]
    first_rows: list[int]

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [N, H_max], teacher_index [N]) in sequence order, for `full_vocab_kl`."""
        return self.hidden_states.values(), self.teacher_index.values()

    def per_sequence(self) -> list[torch.Tensor]:
        """Each sequence's [R_b, H_teacher] rows, unpadded (the inverse of `hidden_states_batch`)."""
        out = []
        for hidden, index in zip(self.hidden_states.unbind(), self.teacher_index.unbind(), strict=True):
            teacher = self.teachers[int(index[0])]
            out.append(hidden[:, : self.hidden_sizes[teacher]])
        return out


def hidden_states_batch(scores: Sequence[TeacherScores]) -> HiddenStatesBatch:
    """Stack the sequences' hidden states into one jagged batch (no padding to a common length)."""
    if not scores:
        raise ValueError("no sequences to batch")
    teachers: list[str] = []
    sizes: dict[str, int] = {}
    for score in scores:
        if score.hidden_states is None:
            raise ValueError(f"request {score.request_id} has no hidden states; score with hidden_states=True")
        size = score.hidden_states.shape[1]
        if sizes.setdefault(score.teacher, size) != size:
            raise ValueError(f"teacher {score.teacher!r} sent hidden sizes {sizes[score.teacher]} and {size}")
        if score.teacher not in teachers:
            teachers.append(score.teacher)
    h_max = max(sizes.values())
    dtype = scores[0].hidden_states.dtype
    rows, index = [], []
    for score in scores:
        hidden = score.hidden_states.to(dtype)
        if hidden.shape[1] < h_max:
            hidden = torch.nn.functional.pad(hidden, (0, h_max - hidden.shape[1]))
        rows.append(hidden)
        index.append(torch.full((hidden.shape[0],), teachers.index(score.teacher), dtype=torch.int64))
    return HiddenStatesBatch(
        hidden_states=torch.nested.nested_tensor(rows, layout=torch.jagged),
        teacher_index=torch.nested.nested_tensor(index, layout=torch.jagged),
        teachers=teachers,
        hidden_sizes=sizes,
        first_rows=[s.first_row for s in scores],
    )
