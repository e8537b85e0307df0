"""vLLM's prompt log-probs → proctor's rows (log-probs [R], top-k ids and log-probs [R, K]),
and per-position hidden states → rows.

Prompt logprobs. vLLM scores a prompt with `SamplingParams(max_tokens=1, prompt_logprobs=K,
detokenize=False)`. Position 0 is None; position i > 0 holds the actual token i (at its true
rank) and the K best candidates (ranks 1..K) of the distribution given tokens 0..i-1, which is
exactly proctor's row i. With `flat_logprobs=True` (used here: no per-position dicts) position i
is the slice start[i]:end[i] of flat lists, the actual token first and then ranks 1..K in order,
so K+1 entries even when the actual token is one of the K. The dict form
(`list[dict[int, Logprob] | None]`, what older vLLM and vLLM-Omni stages may return) collapses
that duplicate, so a position has K or K+1 entries; both forms are handled. (vLLM-Omni's AR
stage answers this way; the vLLM engine scores on the device instead, `vllm.scoring_model`.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from proctor.server.engines.base import (
    EngineError,
)

log = logging.getLogger(__name__)





def _is_flat(prompt_logprobs: Any) -> bool:
    return all(hasattr(prompt_logprobs, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs"))


def extract_rows(
    prompt_logprobs: Any,
    token_ids: Sequence[int] | torch.Tensor,
    first_row: int,
    topk: int,
    *,
    logprobs: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(actual-token log-probs [R], top-k ids [R, K] int32, top-k log-probs [R, K]) for rows
    first_row..T-1 of vLLM's prompt logprobs (flat or dict form); None for what was not asked."""
    ids = _ids_array(token_ids)
    total = len(ids)
    if prompt_logprobs is None or len(prompt_logprobs) != total:
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        raise EngineError(f"engine returned prompt logprobs for {got} positions, expected {total}")
    if _is_flat(prompt_logprobs):
        return _rows_flat(prompt_logprobs, ids, first_row, topk, logprobs)
    return _rows_dicts(prompt_logprobs, ids.tolist(), first_row, topk, logprobs)


def _ids_array(token_ids: Sequence[int] | torch.Tensor) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.numpy().astype(np.int64, copy=False)
    return np.asarray(token_ids, dtype=np.int64)


def _rows_flat(flat: Any, ids: np.ndarray, first_row: int, topk: int, want_lp: bool):
    starts = np.asarray(flat.start_indices[first_row:], dtype=np.int64)
    ends = np.asarray(flat.end_indices[first_row:], dtype=np.int64)
    if starts.size and not np.all(ends - starts == topk + 1):
        raise EngineError(
            f"engine returned {sorted(set((ends - starts).tolist()))} log-probs per position, expected {topk + 1} "
            "(is max_logprobs below the top-k?)"
        )
    values = np.asarray(flat.logprobs, dtype=np.float32)
    lp = ids_out = vals_out = None
    if want_lp:
        cand = np.asarray(flat.token_ids, dtype=np.int64)[starts] if starts.size else np.zeros(0, np.int64)
        if not np.array_equal(cand, ids[first_row:]):
            raise EngineError("engine's prompt logprobs are not for the tokens sent (placeholders expanded?)")
        lp = torch.from_numpy(values[starts].copy())
    if topk:
        gather = starts[:, None] + 1 + np.arange(topk, dtype=np.int64)[None, :]
        vals_out = torch.from_numpy(values[gather].reshape(len(starts), topk).copy())
        ids_out = torch.from_numpy(
            np.asarray(flat.token_ids, dtype=np.int64)[gather].reshape(len(starts), topk).astype(np.int32)
        )
    return lp, ids_out, vals_out


def topk_by_rank(position: Mapping[int, Any], actual: int, topk: int) -> list[tuple[int, float]]:
    """The K best (token, log-prob) of one position of the dict form, best first.

    The dict holds the actual token first and ranks 1..K after it; when the actual token is one
    of the K its entry is overwritten by its top-K twin (same rank), so it has K entries, else
    K+1 and the actual token (rank > K) is dropped. Ties in rank keep insertion order.
    """
    entries = list(position.items())
    if len(entries) == topk + 1:
        entries = [(tok, lp) for tok, lp in entries if tok != actual] or entries[1:]
    ranked = sorted(entries, key=lambda item: (item[1].rank if item[1].rank is not None else 1 << 30))
    if len(ranked) < topk:
        raise EngineError(f"engine returned {len(ranked)} log-probs for a position, expected {topk}")
    return [(int(tok), float(lp.logprob)) for tok, lp in ranked[:topk]]


def _rows_dicts(positions: Sequence[Any], ids: list[int], first_row: int, topk: int, want_lp: bool):
    rows = len(ids) - first_row
    lp = torch.empty(rows, dtype=torch.float32) if want_lp else None
    top_ids = torch.empty((rows, topk), dtype=torch.int32) if topk else None
    top_lp = torch.empty((rows, topk), dtype=torch.float32) if topk else None
    for r in range(rows):
        i = first_row + r
        position = positions[i]
        if position is None:
            raise EngineError(f"engine returned no log-probs for position {i}")
        if lp is not None:
            entry = position.get(ids[i])
            if entry is None:
                raise EngineError(f"engine's log-probs at position {i} do not include token {ids[i]}")
            lp[r] = entry.logprob
        if topk:
            best = topk_by_rank(position, ids[i], topk)
            top_ids[r] = torch.tensor([t for t, _ in best], dtype=torch.int32)
            top_lp[r] = torch.tensor([v for _, v in best], dtype=torch.float32)
    return lp, top_ids, top_lp


def hidden_rows(states: torch.Tensor, total: int, first_row: int) -> torch.Tensor:
    """Rows first_row..T-1 from per-position hidden states [T, H] (row i comes from position i-1)."""
    if states.dim() != 2 or states.shape[0] != total:
        raise EngineError(f"engine returned hidden states of shape {tuple(states.shape)} for {total} tokens")
    return states[first_row - 1 : total - 1]
