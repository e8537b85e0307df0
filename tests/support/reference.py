"""The reference teacher: a plain transformers forward pass, read in proctor's row convention.

Row i is about token i given tokens 0..i-1, so it comes from the logits and the post-norm last
hidden state at position i-1. The logits are the model's own forward's (`model(ids).logits`:
its head and bias and any final soft-cap or scale), never re-derived from the head. The model
runs in float32, as the engines under test serve the tiny teachers (or float64, `dtype`), and
the log-softmax in float64, so the reference adds no rounding of its own to what the engines
are compared against. Nothing here touches proctor's engines; every suite and
benchmark that checks a score checks it against this one forward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from proctor.server.engines.torch.loading import build


def reference_model(model_dir: Path | str, dtype: torch.dtype = torch.float32):
    """The teacher at `model_dir`, loaded once per directory and dtype (suites score many sequences)."""
    return _load(str(Path(model_dir)), dtype)


@functools.cache
def _load(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return build(AutoModelForCausalLM.from_pretrained, model_dir, local_files_only=True, dtype=dtype).eval()


@dataclass(frozen=True)
class ReferenceRows:
    """Rows first_row..T-1 of one sequence: what a server must send for them."""

    first_row: int
    distributions: torch.Tensor  # [R, V] float64: each row's whole log-softmax
    logprobs: torch.Tensor  # [R] float64: log p(token i | tokens < i)
    hidden_states: torch.Tensor  # [R, H] float32: the post-norm activation at position i-1

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64 [R, k], log-probs float64 [R, k]) of each row, most likely first."""
        values, indices = torch.topk(self.distributions, k, dim=-1)
        return indices, values


def reference_rows(
    model_dir: Path | str, token_ids: Sequence[int], first_row: int = 1, *, temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> ReferenceRows:
    """The reference teacher's rows first_row..T-1 for `token_ids` (the logits divided by
    `temperature` before the log-softmax, as a scoring request's temperature asks)."""
    model = reference_model(model_dir, dtype)
    ids = torch.tensor([list(token_ids)])
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden, logits = out.hidden_states[-1][0], out.logits[0]
    positions = slice(first_row - 1, -1)  # position i-1 predicts token i
    distributions = torch.log_softmax(logits[positions].double() / temperature, dim=-1)
    targets = ids[0, first_row:]
    return ReferenceRows(
        first_row=first_row,
        distributions=distributions,
        logprobs=distributions.gather(1, targets[:, None]).squeeze(1),
        hidden_states=hidden[positions].clone(),
    )


def assert_matches_reference(
    actual: torch.Tensor, model_dir: Path | str, token_ids: Sequence[int], *, atol: float, first_row: int = 1
) -> None:
    """Log-probs as a server sent them (any float dtype) equal the reference's to `atol`.

    One comparison for every suite, so that the widening to float64 is done once, here.
    """
    expected = reference_rows(model_dir, token_ids, first_row).logprobs
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=atol)
