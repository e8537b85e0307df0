"""vLLM's `/inference/v1/generate` answer for a scoring call, from one scored request's rows.

A generate call is scored as one `ScoreRequest` over the prompt and one token more (any id: its
row, T, is the teacher's distribution after the whole prompt, whose top-1 is the greedy next
token vLLM would generate at temperature 0). `GeneratePlan` says which rows of that answer are
which part of vLLM's: rows 1..T-1 its `prompt_logprobs` (written by `completion_json`, the
same JSON as `/v1/completions`), rows start+1..T-1 its `prompt_token_id_logprobs` (vLLM's row i
predicts prompt token start + i + 1, proctor's row start + i + 1 is about that token: the same
rows), row T the generated token. The matrix is float32 [rows, K] saved as `.npy` and base64
encoded, as vLLM's `numpy2base64` sends it, cut from the engine's array without a copy per
entry; padded ids score -inf there (vLLM does not clamp them), while `prompt_logprobs` and the
choice's log-probs are clamped at -9999.0 as vLLM clamps them.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proctor.server.front.completion_json import LOGPROB_FLOOR, prompt_logprobs_json
from proctor.server.front.service import ScoredRequest
from proctor.server.front.token_text import TokenText

# The weight version vLLM reports for weights never updated in place: a proctor teacher's are frozen.
_WEIGHT_VERSIONS = [{"version": "default", "start": 0, "end": 1}]


@dataclass(frozen=True)
class GeneratePlan:
    """Where each part of a generate answer lies in the rows of its one scored request."""

    num_prompt: int  # T, the prompt's tokens (the scored sequence has T + 1)
    first_row: int  # the scored request's first row
    prompt_topk: int | None  # vLLM's prompt_logprobs K (None: not asked)
    id_rows: int  # rows of prompt_token_id_logprobs (0: not asked)
    id_start: int  # vLLM's prompt_logprob_start
    choice_logprobs: int | None  # vLLM's sampling_params.logprobs for the generated token

    @property
    def topk(self) -> int:
        """The top-k the scored request asks: the prompt's K, the choice's, and the greedy token."""
        return max(self.prompt_topk or 0, self.choice_logprobs or 0, 1)


@dataclass(frozen=True)
class GenerateReply:
    """What of the call, besides its scores, the answer repeats."""

    request_id: str
    model: str
    prompt: Sequence[int]
    return_token_ids: bool
    stop_ids: frozenset[int]  # the teacher's EOS ids ending a generation ("stop"); empty with ignore_eos


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def npy_base64(matrix: np.ndarray) -> str:
    """An array as vLLM's `numpy2base64` sends it: its `.npy` bytes in base64."""
    buffer = io.BytesIO()
    np.save(buffer, matrix, allow_pickle=False)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def _prompt_logprobs(plan: GeneratePlan, prompt: Sequence[int], scored: ScoredRequest, text: TokenText) -> str:
    result, rows, k = scored.result, plan.num_prompt - 1, plan.prompt_topk or 0
    return prompt_logprobs_json(
        np.asarray(prompt, dtype=np.int64), result.logprobs.numpy()[:rows],
        None if result.ranks is None else result.ranks.numpy()[:rows],
        result.topk_ids.numpy()[:rows, :k] if k else None,
        result.topk_logprobs.numpy()[:rows, :k] if k else None, text)


def _choice(plan: GeneratePlan, scored: ScoredRequest, stop_ids: frozenset[int]) -> dict:
    """The one generated token, as vLLM's `GenerateTokensChoice` (greedy: rank 1, its top-N)."""
    last = plan.num_prompt - plan.first_row
    ids = scored.result.topk_ids.numpy()[last]
    values = np.maximum(scored.result.topk_logprobs.numpy()[last].astype(np.float64), LOGPROB_FLOOR).tolist()
    token = int(ids[0])
    logprobs = None
    if plan.choice_logprobs is not None:
        top = [{"token_id": int(i), "logprob": v, "rank": r + 1}
               for r, (i, v) in enumerate(zip(ids[: max(plan.choice_logprobs, 1)].tolist(), values, strict=False))]
        logprobs = {"content": [{"token_id": token, "logprob": values[0], "rank": 1, "top_logprobs": top}]}
    return {"index": 0, "finish_reason": "stop" if token in stop_ids else "length", "stop_reason": None,
            "token_ids": [token], "routed_experts": None, "sampling_mask": None,
            "weight_versions": _WEIGHT_VERSIONS, "logprobs": logprobs}


def id_logprobs(plan: GeneratePlan, scored: ScoredRequest) -> np.ndarray | None:
    """prompt_token_id_logprobs as vLLM's array: float32 [rows, K], -inf at padding."""
    if not plan.id_rows:
        return None
    first = plan.id_start + 1 - plan.first_row
    return np.ascontiguousarray(scored.result.score_logprobs.numpy()[first : first + plan.id_rows], dtype=np.float32)


def tito_answer(plan: GeneratePlan, reply: GenerateReply, scored: ScoredRequest, text: TokenText) -> bytes:
    """The whole answer, serialised in vLLM's field order; the prompt log-probs are written
    column-wise (`completion_json`), the matrix by numpy, the rest by `json.dumps`."""
    prompt_logprobs = "null" if plan.prompt_topk is None else _prompt_logprobs(plan, reply.prompt, scored, text)
    matrix = id_logprobs(plan, scored)
    usage = {"prompt_tokens": plan.num_prompt, "total_tokens": plan.num_prompt + 1, "completion_tokens": 1,
             "prompt_tokens_details": None, "completion_tokens_details": None}
    head = {"request_id": reply.request_id, "model": reply.model, "created": int(time.time()), "usage": usage}
    tail = {"prompt_token_id_logprobs": None if matrix is None else npy_base64(matrix),
            "prompt_token_ids": list(reply.prompt) if reply.return_token_ids else None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": [_choice(plan, scored, reply.stop_ids)]}
    return f'{_dumps(head)[:-1]},"prompt_logprobs":{prompt_logprobs},{_dumps(tail)[1:]}'.encode()
