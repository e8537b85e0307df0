"""verl's row layout for teacher answers: where each scored token's top-k lands in verl's batch.

Kept apart from the client (`verl_client`) because trainers that batch verl-style outside verl's
agent loop use it on its own, and because it is the one place that encodes verl's off-by-one
row convention, so a change in verl's layout is a change here only.

Proctor's rows: row i is about token i given tokens 0..i-1, rows first_row..T-1 sent.
verl's rows (`verl/experimental/teacher_loop/teacher_manager.py`, fed by
`verl/workers/rollout/vllm_rollout/utils.py::extract_prompt_logprobs`): one row per token,
row i is the distribution that predicts token i+1 (the logits at position i), the last row a
dummy of zeros; `_pad_teacher_outputs` then left-pads the prompt part to the batch's prompt
width and right-pads the response part to its response width (ids with the pad token,
log-probs with 0.0), and the agent loop concatenates sequences into
`teacher_ids` / `teacher_logprobs` of shape [B, prompt_width + response_width, K]. With
`topk = 0` (sampled-token losses) K is 1 and row i holds token i+1 and its log-prob.
Nothing here imports verl.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proctor.client import TeacherScores


def verl_rows(
    scores: TeacherScores, token_ids: Sequence[int] | torch.Tensor, *, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in verl's unpadded layout: (ids int32 [T, K'], log-probs float32 [T, K']).

    K' = topk, or 1 with topk = 0 (then ids are the sequence's own next tokens). Rows the
    server did not send (before first_row - 1, i.e. inside the prompt) and the last row are
    zeros, as verl's dummy row; trainers only read rows from the last prompt token on.
    """
    tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
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
    """`teacher_ids` int32 and `teacher_logprobs` float32, both [B, prompt_width + response_width, K'].

    What verl's agent loop assembles from `ProctorTeacherClient` answers, for trainers that
    batch verl-style outside that loop (the README's trainer-side API); equal to verl's own
    padding and concatenation (tests/test_verl_adapter.py).
    """
    if not len(scores) == len(token_ids) == len(prompt_lengths):
        raise ValueError("scores, token_ids and prompt_lengths must have one entry per sequence")
    ids_out, lps_out = [], []
    for score, tokens, prompt_length in zip(scores, token_ids, prompt_lengths, strict=True):
        ids, lps = verl_rows(score, tokens, topk=topk)
        layout = {"prompt_length": prompt_length, "prompt_width": prompt_width, "response_width": response_width}
        ids_out.append(pad_verl_rows(ids, value=pad_token_id, **layout))
        lps_out.append(pad_verl_rows(lps, value=0.0, **layout))
    return {"teacher_ids": torch.cat(ids_out, dim=0), "teacher_logprobs": torch.cat(lps_out, dim=0)}


def verl_hidden_rows(scores: TeacherScores) -> torch.Tensor:
    """Hidden states [T, H] in verl's row convention: row i produced the prediction of token
    i+1 (the activation at position i); rows the server did not send and the last are zeros."""
    if scores.hidden_states is None:
        raise ValueError("no hidden states in these scores; score with hidden_states=True")
    hidden = scores.hidden_states
    out = torch.zeros((scores.num_tokens, hidden.shape[1]), dtype=hidden.dtype)
    out[scores.first_row - 1 : scores.num_tokens - 1] = hidden
    return out
