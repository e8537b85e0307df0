"""`TeacherScores`, one sequence's answer on the trainer side, and its reading from the wire.

Its own module because both the client and the aligned answers (`proctor.client.aligned`) are
built from it: the client imports the aligned answers, so neither may hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proctor.proto import decode_tensor, scoring_pb2


@dataclass
class TeacherScores:
    """The teacher's answer for one sequence: rows first_row..num_tokens-1.

    Tensors are owned copies (safe to write). `logprobs[r]` is log p(token first_row + r |
    tokens before it); `hidden_states[r]` is the teacher's last-layer state that produced
    that distribution (the activation at position first_row + r - 1).
    """

    request_id: str
    teacher: str
    model: str
    num_tokens: int
    first_row: int
    logprobs: torch.Tensor | None = None  # float32 [R]
    topk_ids: torch.Tensor | None = None  # int32 [R, K]
    topk_logprobs: torch.Tensor | None = None  # float32 [R, K]
    hidden_states: torch.Tensor | None = None  # [R, H], the teacher's dtype, or as `hidden_form` asked
    # float32 [R, K]: the teacher's full-vocabulary log-probs at the request's score_ids (-inf at padding)
    score_logprobs: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.num_tokens - self.first_row



def _owned(message: scoring_pb2.Tensor) -> torch.Tensor:
    # decode_tensor is a read-only view over the message bytes; callers get a writable copy.
    return decode_tensor(message).clone()


def scores_from_response(response: scoring_pb2.ScoreResponse | scoring_pb2.ScoreChunk) -> TeacherScores:
    scores = TeacherScores(
        request_id=response.request_id, teacher=response.teacher, model=response.model,
        num_tokens=response.num_tokens, first_row=response.first_row,
    )
    for name in ("logprobs", "topk_ids", "topk_logprobs", "hidden_states", "score_logprobs"):
        if response.HasField(name):
            setattr(scores, name, _owned(getattr(response, name)))
    return scores
