"""loss_metrics: logging statistics over valid tokens only."""

from __future__ import annotations

import math

import torch

from proctor.client.loss import loss_metrics


def test_statistics_ignore_masked_tokens():
    loss = torch.tensor([1.0, 100.0, 3.0, -50.0])
    mask = torch.tensor([True, False, True, False])
    m = loss_metrics(loss, mask)
    assert m == {"loss": 2.0, "loss_min": 1.0, "loss_max": 3.0}


def test_topk_masses_are_averaged_over_valid_tokens():
    loss = torch.zeros(3)
    mask = torch.tensor([True, True, False])
    m = loss_metrics(loss, mask, student_mass=torch.tensor([0.2, 0.4, 0.9]), teacher_mass=torch.tensor([0.5, 0.7, 0.0]))
    assert math.isclose(m["student_mass"], 0.3, rel_tol=1e-6)
    assert math.isclose(m["teacher_mass"], 0.6, rel_tol=1e-6)


def test_fully_masked_batch_gives_nan_not_an_error():
    m = loss_metrics(torch.ones(2), torch.zeros(2, dtype=torch.bool))
    assert all(math.isnan(v) for v in m.values())
