"""The torch engine's batch-invariant scoring (`inference.batch_invariant`, `engines/invariance.py`).

The engine's usual pass pads a batch to its longest sequence and runs one forward over all of it,
then one lm_head pass over every request's rows: fast, but each matmul's and attention's shape
(and with it the kernel's blocking and its order of additions) depends on the whole batch, so a
sequence's scores change in their last bits with its batch-mates, its padding and its place in the
batch (`tests/test_batch_invariance.py` shows the padded pass differing).

Here every reduction has a shape fixed by the sequence alone: one forward of the decoder body per
sequence, unpadded and without an attention mask (causal attention over its own tokens), and the
lm_head and row scores (`row_scores.score_rows`) over that request's rows alone, in its own row
chunks, at its own top-k width. The same sequence then runs the same kernels on the same shapes,
each input laid out the same (fresh, contiguous tensors), whatever else is in the batch, and two
replicas on one device type agree bit for bit. The price is batching inside the forward
(`bench/batch_invariant.py` measures it); the batcher still batches requests, so the queueing,
admission and per-call costs are shared as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from proctor.server.engines.base import EngineRequest, EngineResult
from proctor.server.engines.token_ids import index_tensor


def sequence_states(body: torch.nn.Module, batch: list[EngineRequest]) -> list[torch.Tensor]:
    """Each request's hidden-state rows first_row..T-1 from a forward of its own tokens alone."""
    device = next(body.parameters()).device
    states = []
    for request in batch:
        ids = index_tensor(request.token_ids).to(device)[None]
        hidden = body(input_ids=ids, use_cache=False).last_hidden_state[0]
        states.append(hidden[request.first_row - 1 : request.num_tokens - 1].contiguous())
    return states


HeadPass = Callable[[torch.nn.Module, list[EngineRequest], list[torch.Tensor], list[EngineResult]], None]


def per_request(head: HeadPass) -> HeadPass:
    """`head` (the engine's lm_head pass over a batch's rows) run over one request's rows at a time."""

    def each(model: torch.nn.Module, batch: list[EngineRequest], states: list[torch.Tensor],
             results: list[EngineResult]) -> None:
        for request, rows, result in zip(batch, states, results, strict=True):
            head(model, [request], [rows], [result])

    return each
