"""Trainer-side client of a proctor server: scoring calls, batch layouts, and the losses.

`TeacherClient` (asyncio) and `SyncTeacherClient` (blocking) talk gRPC or HTTP; errors are
`TeacherError`s; `proctor.client.batch` turns per-sequence scores into trainer tensors;
`proctor.client.loss` holds the distillation losses. Imports only `proctor.proto`.
"""

from proctor.client.aligned import AlignedBatch, AlignedScores, pack_aligned
from proctor.client.client import RequestFields, ScoreInput, TeacherClient, TeacherInfo, TeacherScores
from proctor.client.retry import NO_RETRY, RetryPolicy
from proctor.client.sync import SyncTeacherClient
from proctor.client.transports import (
    DeadlineExceeded,
    InvalidArgument,
    Media,
    PayloadTooLarge,
    ResourceExhausted,
    TeacherError,
    TeacherNotFound,
    Unauthenticated,
    Unavailable,
    UnembeddingMismatch,
)

__all__ = [
    "NO_RETRY",
    "AlignedBatch",
    "AlignedScores",
    "DeadlineExceeded",
    "InvalidArgument",
    "Media",
    "PayloadTooLarge",
    "RequestFields",
    "ResourceExhausted",
    "RetryPolicy",
    "ScoreInput",
    "SyncTeacherClient",
    "TeacherClient",
    "TeacherError",
    "TeacherInfo",
    "TeacherNotFound",
    "TeacherScores",
    "Unauthenticated",
    "Unavailable",
    "UnembeddingMismatch",
    "pack_aligned",
]
