"""`proctor demo`: a noisy student distilled from the tiny teacher really converges."""

from __future__ import annotations

import json

from PIL import Image

from proctor.trainer_adapter.demo import run_demo
from proctor.trainer_adapter.plot import _raster, _write_png


def test_full_forward_kl_demo_halves_the_loss_and_writes_a_plot(tmp_path, capsys):
    assert run_demo(steps=8, loss="full_forward_kl", transport="grpc", out=tmp_path, seed=0) == 0
    logs = json.loads((tmp_path / "loss_full_forward_kl.json").read_text())
    losses = [entry["loss"] for entry in logs]
    assert len(losses) == 8
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(entry["loss_min"] <= entry["loss"] <= entry["loss_max"] for entry in logs)
    assert all(entry["tokens_per_s"] > 0 for entry in logs)
    with Image.open(tmp_path / "loss_full_forward_kl.png") as image:
        assert image.size[0] > 100
    printed = capsys.readouterr().out
    assert "distillation/loss" in printed and "loss_min" in printed and "tok/s" in printed
    assert "through HTTP: max |gRPC - HTTP| = 0.00e+00" in printed  # the quickstart part


def test_demo_refuses_unknown_options(tmp_path, capsys):
    assert run_demo(steps=2, loss="mse_logits", out=tmp_path) == 2
    assert run_demo(steps=2, transport="carrier-pigeon", out=tmp_path) == 2
    assert "--loss must be one of" in capsys.readouterr().err


def test_builtin_png_writer_makes_a_readable_image(tmp_path):
    path = tmp_path / "curve.png"
    _write_png(path, *_raster([3.0, 2.0, 1.0, 0.5], [1.0, 0.5, 0.2, 0.1], [5.0, 4.0, 2.0, 1.0]))
    with Image.open(path) as image:
        assert image.size == (480, 240) and image.mode == "RGB"
        assert image.getpixel((240, 120)) is not None
