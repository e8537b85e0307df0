"""A teacher's per-row outputs from its logits: the one rule every engine scores rows by.

Given the logits of N rows (the model's own logits path produced them: lm_head, bias, logit
scale, final soft-cap, vocab-parallel gather), each row's target token, its temperature, the
top-k width and the ids to score, this computes, in float32 on the logits' device:
the target's log-prob and, when asked, its true rank (1 + the tokens strictly more likely), the top-k ids
and log-probs (sorted, so a narrower request's top-k is a prefix), and the log-probs at the
given ids (-1: padding, -inf out). Temperature divides the logits before the log-softmax.

The torch engine calls it on its lm_head's rows; the vLLM scoring pooler calls it inside vLLM's
worker, next to the logits, so only these compact tensors leave the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Rows of logits materialised at once: bounds memory for large vocabularies ([rows, V] float32).
LOGIT_ROWS = 1024


@dataclass
class RowScores:
    """Outputs for N rows, in the rows' order (each None when not asked for)."""

    logprobs: torch.Tensor  # float32 [N]
    ranks: torch.Tensor | None  # int32 [N]; None when not asked
    topk_ids: torch.Tensor | None = None  # int32 [N, K]
    topk_logprobs: torch.Tensor | None = None  # float32 [N, K]
    score_logprobs: torch.Tensor | None = None  # float32 [N, Ks]


def score_rows(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    topk: int = 0,
    temperatures: torch.Tensor | None = None,
    score_ids: torch.Tensor | None = None,
    ranks: bool = True,
    chunk_rows: int = LOGIT_ROWS,
) -> RowScores:
    """Scores of N rows from their hidden states [N, H] through `logits_of` ([n, H] -> [n, V]),
    in chunks of `chunk_rows` rows so that no [N, V] tensor exists.

    `targets` [N] are the tokens each row is about (a row without one, e.g. a prompt's next-token
    row, may carry any valid id and ignore the log-prob); `temperatures` [N] float32 or None for
    T = 1 everywhere; `score_ids` [N, Ks] int (-1 padding) or None; `ranks` False leaves the
    ranks out (a comparison over every row's vocabulary, as costly as the log-softmax itself).
    """
    parts: dict[str, list[torch.Tensor]] = {"lp": [], "rank": [], "ids": [], "vals": [], "score": []}
    for lo in range(0, hidden.shape[0], chunk_rows):
        hi = min(lo + chunk_rows, hidden.shape[0])
        logits = logits_of(hidden[lo:hi]).float()
        if temperatures is not None:
            logits = logits / temperatures[lo:hi, None]
        logp = torch.log_softmax(logits, dim=-1)
        actual = logp.gather(1, targets[lo:hi, None].long())
        parts["lp"].append(actual.squeeze(1))
        if ranks:
            parts["rank"].append(((logp > actual).sum(dim=1) + 1).to(torch.int32))
        if topk:
            values, indices = torch.topk(logp, topk, dim=-1)
            parts["vals"].append(values)
            parts["ids"].append(indices.to(torch.int32))
        if score_ids is not None:
            chunk = score_ids[lo:hi].long()
            parts["score"].append(logp.gather(1, chunk.clamp_min(0)).masked_fill_(chunk < 0, float("-inf")))
    if not parts["lp"]:  # no rows: empty outputs of the right widths
        device = hidden.device
        empty = RowScores(torch.empty(0, device=device),
                          torch.empty(0, dtype=torch.int32, device=device) if ranks else None)
        if topk:
            empty.topk_ids = torch.empty((0, topk), dtype=torch.int32, device=device)
            empty.topk_logprobs = torch.empty((0, topk), device=device)
        if score_ids is not None:
            empty.score_logprobs = torch.empty((0, score_ids.shape[1]), device=device)
        return empty
    return RowScores(
        logprobs=torch.cat(parts["lp"]),
        ranks=torch.cat(parts["rank"]) if ranks else None,
        topk_ids=torch.cat(parts["ids"]) if topk else None,
        topk_logprobs=torch.cat(parts["vals"]) if topk else None,
        score_logprobs=torch.cat(parts["score"]) if score_ids is not None else None,
    )
