"""Blocking scoring calls on the wire, and the token sequences suites send.

Straight through the generated stubs, not through `proctor.client`, so that server suites
test the server alone.
"""

from __future__ import annotations

import functools

import grpc
import torch

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import decode_tensor


def sequences(count: int, *, vocab: int = 512, length: tuple[int, int] = (6, 40), seed: int = 0) -> list[list[int]]:
    """`count` random token-id sequences with lengths in [length[0], length[1]), reproducible by seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(length[0], length[1], (1,), generator=g))
        out.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    return out


@functools.cache
def _stub(target: str) -> scoring_pb2_grpc.TeacherScoringStub:
    return scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(target))


def grpc_score(target: str, ids: list[int], *, teacher_key: str = "", request_id: str = "", topk: int = 0,
               timeout: float = 60) -> scoring_pb2.ScoreResponse:
    """One unary Score call asking for log-probs (and top-k), on a channel reused per target."""
    request = scoring_pb2.ScoreRequest(
        request_id=request_id, teacher_key=teacher_key, token_ids=ids, logprobs=True, topk=topk
    )
    return _stub(target).Score(request, timeout=timeout)


def logprobs_of(response: scoring_pb2.ScoreResponse) -> torch.Tensor:
    """The response's log-probs as a tensor of its own (the decoded one views the message's bytes)."""
    return decode_tensor(response.logprobs).clone()
