"""The start-time probe of the torch engine's reuse path against this transformers release.

The shared-prefix path (`torch.prefix`) builds on transformers' cache internals, which change
between releases. `reuse_works` runs it at replica start on a tiny input against the plain padded
pass: where it raises or differs, prompt reuse is off for that engine (one log line) and every
request is scored whole; a replica never fails for it.
"""

from __future__ import annotations

import logging

import torch

from proctor.proto.versions import installed
from proctor.server.engines.base import EngineRequest, EngineResult
from proctor.server.engines.prompt_reuse import ReuseSettings
from proctor.server.engines.token_ids import token_array
from proctor.server.engines.torch.prefix import PaddedPass, TorchPrefix

log = logging.getLogger("proctor.server.engines.torch.prefix")  # one logger for the reuse path's lines


# The probe's tiny input: one prompt, a batch of a leader and a member (the leader's own state),
# then members from the store; how far the reuse path may be from the plain pass, relative to it.
_PROBE_PROMPT, _PROBE_RESPONSES = 6, ((4, 2), (3, 5))
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
_PROBE_HALF_TOLERANCE = 3e-2


def reuse_works(body: torch.nn.Module, padded: PaddedPass) -> bool:
    """Whether this transformers release's cache internals serve the reuse path: a tiny group
    scored through it (a leader, a member in its batch, members from the store) equals the plain
    padded pass. False (after one log line saying reuse is off) where it raises or differs."""
    try:
        with torch.inference_mode():
            gap = _probe_gap(body, padded)
    except Exception as exc:  # any failure of the internals is a reason to score whole, not to fail
        why = f"{type(exc).__name__}: {exc}"
    else:
        if gap is None:  # the path turned itself off and said so (not a full-attention KV cache)
            return False
        dtype = next(body.parameters()).dtype
        if gap <= _PROBE_TOLERANCE.get(dtype, _PROBE_HALF_TOLERANCE):
            return True
        why = f"its rows differ from the plain pass by {gap:.3g} (relative)"
    log.warning("prompt reuse off for this teacher: the shared-prefix path does not work with transformers %s "
                "(%s); every request is scored whole", installed("transformers"), why)
    return False


def _probe_gap(body: torch.nn.Module, padded: PaddedPass) -> float | None:
    """The largest relative difference between the reuse path's computed rows and the plain pass's
    over the probe's requests; None when the reuse path turned itself off."""
    vocab = int(getattr(body.config, "vocab_size", 0) or 16)
    width = _PROBE_PROMPT + max(max(batch) for batch in _PROBE_RESPONSES)
    ids = (torch.arange(width * len(_PROBE_RESPONSES) * 2) * 7 + 3).remainder(vocab)
    prompt, offset = ids[:_PROBE_PROMPT], _PROBE_PROMPT
    prefix = TorchPrefix(ReuseSettings(enabled=True, min_tokens=_PROBE_PROMPT - 1, block_tokens=2))
    worst = 0.0
    for step, lengths in enumerate(_PROBE_RESPONSES):
        batch = []
        for index, length in enumerate(lengths):
            response = ids[offset : offset + length]
            offset += length
            batch.append(EngineRequest(request_id=f"probe{step}.{index}", token_ids=token_array(torch.cat([prompt, response])),
                                       first_row=_PROBE_PROMPT, logprobs=True, topk=0, hidden_states=False))
        scored = prefix.states(body, batch, padded)
        if not prefix.settings.enabled:
            return None
        leaders = len(scored.plan.leaders)
        if leaders != (1 if step == 0 else 0) or len(scored.plan.followers) != len(batch) - leaders:
            raise RuntimeError(f"the reuse path planned {leaders} leaders among {len(batch)} requests of one prompt")
        plain, _ = padded(body, batch, False)
        for ours, theirs, view in zip(scored.states, plain, scored.views, strict=True):
            theirs = theirs[view.first_row - _PROBE_PROMPT :]
            if ours.shape != theirs.shape:
                raise RuntimeError(f"rows of shape {tuple(ours.shape)}, the plain pass's {tuple(theirs.shape)}")
            scale = float(theirs.float().norm()) or 1.0
            worst = max(worst, float((ours.float() - theirs.float()).norm()) / scale)
        prefix.finish(scored, [EngineResult(first_row=v.first_row, logprobs=torch.zeros(v.num_rows),
                                            ranks=torch.ones(v.num_rows, dtype=torch.int64)) for v in scored.views])
    return worst
