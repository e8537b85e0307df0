"""Shim for tests/test_ray.py only, while it is being changed elsewhere: import from `support`.

Remove once test_ray.py imports `support.configs`, `support.scoring`, `support.servers` and
`support.reference` (its float32 comparisons become `assert_matches_reference`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from support.configs import cpu_config, torch_teacher, write_config
from support.reference import reference_rows
from support.scoring import grpc_score, logprobs_of, sequences
from support.servers import wait_for

__all__ = ["cpu_config", "grpc_score", "logprobs_of", "reference_logprobs", "sequences", "torch_teacher",
           "wait_for", "write_config"]


def reference_logprobs(model_dir: Path | str, ids: list[int], first_row: int = 1) -> torch.Tensor:
    """The reference's log-probs rounded to float32, the dtype test_ray.py compares them in."""
    return reference_rows(model_dir, ids, first_row).logprobs.float()
