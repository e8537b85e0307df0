"""GRPO-shaped traffic for the shared-prompt suites and bench: groups of responses to one prompt,
and the check of an engine's answer against an independent uncached forward.

A group's members differ in response length (one-token responses included) and one member's
response starts with the same tokens as another's, so a prefix cache can reach past the prompt
into the response: the case an engine must not read stale rows for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from proctor.server.engines.base import EngineRequest, EngineResult

from support.reference import reference_rows

FP32_ATOL = 1e-5


@dataclass(frozen=True)
class Member:
    group: int
    index: int
    token_ids: torch.Tensor
    prompt_length: int


def make_groups(
    prompt_lengths: list[int], members: int, *, response: tuple[int, int], vocab: int = 512, seed: int = 0,
    shared_start: int = 0,
) -> list[list[Member]]:
    """One group per prompt length: `members` sequences prompt + response, response lengths drawn
    from `response` (the first member's response is one token when the range allows). With
    `shared_start` > 0, member 1's response begins with member 0's first `shared_start` tokens."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g, length in enumerate(prompt_lengths):
        prompt = torch.randint(3, vocab, (length,), generator=gen)
        responses = []
        for _ in range(members):
            size = int(torch.randint(response[0], response[1] + 1, (1,), generator=gen))
            responses.append(torch.randint(3, vocab, (max(1, size),), generator=gen))
        if response[0] <= 1 and members > 2:
            responses[2] = responses[2][:1]
        if shared_start and members > 1:
            head = responses[0][:shared_start]
            tail = responses[1][: max(1, len(responses[1]) - len(head))]
            responses[1] = torch.cat([head, tail])
        groups.append([Member(g, m, torch.cat([prompt, r]), length) for m, r in enumerate(responses)])
    return groups


def interleaved(groups: list[list[Member]], seed: int = 0) -> list[Member]:
    """Every member of every group, shuffled (groups interleave, members arrive out of order)."""
    flat = [m for group in groups for m in group]
    random.Random(seed).shuffle(flat)
    return flat


def request_of(member: Member, *, topk: int = 0, hidden: bool = False, score_ids: bool = False,
               temperature: float = 1.0, whole: bool = False, ranks: bool = True) -> EngineRequest:
    """The member as an engine request: rows from its prompt length, or with `whole` every row from
    1 (a client that sends no prompt length: verl's teacher loop, `/v1/completions`). Its score_ids
    depend on the row and the group only, as a student's top-k over a shared prompt would."""
    first_row = 1 if whole else member.prompt_length
    ids = None
    if score_ids:
        rows = member.token_ids.shape[0] - first_row
        ids = ((torch.arange(first_row, first_row + rows)[:, None] * 3 + torch.arange(3)) * 7 + member.group) % 500
        ids[(torch.arange(first_row, first_row + rows) % 2) == 0, 2] = -1
    return EngineRequest(
        request_id=f"g{member.group}m{member.index}", token_ids=member.token_ids, first_row=first_row,
        logprobs=True, topk=topk, hidden_states=hidden, score_ids=ids, temperature=temperature,
        ranks=ranks,
    )


def assert_exact(result: EngineResult, request: EngineRequest, model_dir: Path | str, *,
                 atol: float = FP32_ATOL, hidden_atol: float | None = None) -> None:
    """The engine's rows equal the independent uncached forward's: log-probs, ranks, top-k (ids
    equal, values to atol), score_ids, hidden states."""
    ref = reference_rows(model_dir, request.token_ids.tolist(), request.first_row, temperature=request.temperature)
    assert result.first_row == request.first_row
    torch.testing.assert_close(result.logprobs.double(), ref.logprobs, rtol=0, atol=atol)
    assert (result.ranks is not None) == request.ranks, request.request_id  # computed exactly when asked
    if request.ranks:
        expected_ranks = (ref.distributions > ref.logprobs[:, None]).sum(dim=1) + 1
        assert torch.equal(result.ranks.long(), expected_ranks), request.request_id
    if request.topk:
        ids, values = ref.topk(request.topk)
        assert torch.equal(result.topk_ids.long(), ids), request.request_id
        torch.testing.assert_close(result.topk_logprobs.double(), values, rtol=0, atol=atol)
    if request.score_ids is not None:
        score_ids = torch.from_numpy(request.score_ids.astype(np.int64))
        picked = ref.distributions.gather(1, score_ids.clamp_min(0)).masked_fill(score_ids < 0, float("-inf"))
        torch.testing.assert_close(result.score_logprobs.double(), picked, rtol=0, atol=atol)
    if request.hidden_states:
        torch.testing.assert_close(result.hidden_states.float(), ref.hidden_states, rtol=0,
                                   atol=hidden_atol if hidden_atol is not None else atol)
