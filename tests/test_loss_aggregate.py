"""aggregate: verl's agg_loss modes on padded and packed layouts; masking."""

from __future__ import annotations

import pytest
import torch

from proctor.client.loss import AGG_MODES, aggregate


def _batch():
    g = torch.Generator().manual_seed(0)
    loss = torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    return loss, mask


def test_token_mean_is_mean_over_valid_tokens():
    loss, mask = _batch()
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(loss[mask].mean().item())


def test_token_sum_is_sum_over_valid_tokens():
    loss, mask = _batch()
    assert aggregate(loss, mask, "token-sum").item() == pytest.approx(loss[mask].sum().item())


def test_seq_mean_token_sum_skips_fully_masked_sequences():
    loss, mask = _batch()
    expected = ((loss[0, :3].sum() + loss[1].sum()) / 2).item()
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_divides_by_the_horizon():
    loss, mask = _batch()
    expected = ((loss[0, :3].sum() + loss[1].sum()) / 2 / 5).item()
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(expected)


def test_seq_mean_token_mean_averages_per_sequence_means():
    loss, mask = _batch()
    expected = ((loss[0, :3].mean() + loss[1].mean()) / 2).item()
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", [m for m in AGG_MODES if m != "seq-mean-token-sum-norm"])
def test_packed_layout_with_seq_index_equals_padded_layout(mode):
    loss, mask = _batch()
    seq_index = torch.arange(3).repeat_interleave(5)
    packed = aggregate(loss.reshape(-1), mask.reshape(-1), mode, seq_index=seq_index)
    assert packed.item() == pytest.approx(aggregate(loss, mask, mode).item(), rel=1e-9)


def test_masked_tokens_contribute_nothing_even_when_not_finite():
    loss, mask = _batch()
    loss = loss.clone().requires_grad_()
    poisoned = torch.where(mask, loss, torch.tensor(float("nan"), dtype=loss.dtype))
    out = aggregate(poisoned, mask, "token-mean")
    out.backward()
    assert torch.isfinite(out)
    assert torch.count_nonzero(loss.grad[~mask]) == 0


def test_global_token_count_and_dp_size_scale_like_verl():
    loss, mask = _batch()
    out = aggregate(loss, mask, "token-mean", dp_size=4, batch_num_tokens=32)
    assert out.item() == pytest.approx(loss[mask].sum().item() / 32 * 4)


def test_unknown_mode_raises_naming_mode():
    loss, mask = _batch()
    with pytest.raises(ValueError, match="mode"):
        aggregate(loss, mask, "mean")
