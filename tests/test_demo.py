"""`proctor demo`: a noisy student distilled from the tiny teacher really converges."""

from __future__ import annotations

import json

from PIL import Image
from typer.testing import CliRunner

from proctor.server.cli.main import app
from proctor.trainer_adapter.demo import run_demo
from proctor.trainer_adapter.plot import _raster, _write_png

LINE = (30, 90, 200)  # the builtin writer's curve
BAND = (200, 220, 245)  # and its loss_min..loss_max band


def test_full_forward_kl_demo_halves_the_loss_and_writes_a_plot(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--steps", "8", "--loss", "full_forward_kl", "--transport", "grpc",
                                      "--out", str(tmp_path), "--seed", "0"])
    assert result.exit_code == 0, result.output
    logs = json.loads((tmp_path / "loss_full_forward_kl.json").read_text())
    losses = [entry["loss"] for entry in logs]
    assert len(losses) == 8
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(entry["loss_min"] <= entry["loss"] <= entry["loss_max"] for entry in logs)
    assert all(entry["tokens_per_s"] > 0 for entry in logs)
    with Image.open(tmp_path / "loss_full_forward_kl.png") as image:
        assert image.size[0] > 100
    printed = result.output
    assert "distillation/loss" in printed and "loss_min" in printed and "tok/s" in printed
    assert "through HTTP: max |gRPC - HTTP| = 0.00e+00" in printed  # the quickstart part
    # The loss said in words and its unit (not only the loss library's name for it), and no
    # progress bar when the output is not a terminal: every step is one whole line.
    assert ("loss full_forward_kl: KL(teacher || student) over the whole vocabulary, from the teacher's hidden "
            "states, in nats per response token (the loss library's loss_mode 'nitrobrew', verl-omni's name)") in printed
    assert "distilling" not in printed and "\r" not in printed
    assert sum(line.startswith("step ") and "tok/s" in line for line in printed.splitlines()) == 8


def test_every_demo_loss_is_explained():
    from proctor.trainer_adapter.demo import LOSSES, MEANINGS

    assert set(MEANINGS) == set(LOSSES)


def test_fp8_hidden_states_demo_falls_like_the_exact_one(tmp_path):
    """`--hidden-form fp8`: the teacher's hidden states travel as fp8 rows (over HTTP here, the
    other transport) and the loss falls as the exact form's does (same seed, same student)."""
    curves = {}
    for form in ("", "fp8"):  # into one folder: each form's plot and log beside the other's
        result = CliRunner().invoke(app, ["demo", "--steps", "8", "--transport", "http", "--hidden-form", form,
                                          "--out", str(tmp_path), "--seed", "0"])
        assert result.exit_code == 0, result.output
        stem = "loss_full_forward_kl_fp8" if form else "loss_full_forward_kl"
        curves[form] = [e["loss"] for e in json.loads((tmp_path / f"{stem}.json").read_text())]
    assert (tmp_path / "loss_full_forward_kl.png").is_file() and (tmp_path / "loss_full_forward_kl_fp8.png").is_file()
    exact, fp8 = curves[""], curves["fp8"]
    assert fp8[-1] < 0.5 * fp8[0], fp8
    assert abs(fp8[-1] / fp8[0] - exact[-1] / exact[0]) < 0.05, (exact, fp8)
    refused = CliRunner().invoke(app, ["demo", "--hidden-form", "fp4", "--out", str(tmp_path)])
    assert refused.exit_code == 2 and "--hidden-form must be one of" in refused.output


def test_student_topk_reverse_kl_demo_scores_the_students_support_and_the_loss_falls(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--steps", "8", "--loss", "student_topk_reverse_kl", "--out",
                                      str(tmp_path)])
    assert result.exit_code == 0, result.output
    losses = [entry["loss"] for entry in json.loads((tmp_path / "loss_student_topk_reverse_kl.json").read_text())]
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0], losses


def test_omni_demo_distils_the_thinker_on_image_and_audio_prompts(tmp_path):
    """`--teacher omni`: every rollout carries a PNG and a WAV to the tiny Qwen2.5-Omni Thinker;
    the loss only falls if the teacher scores the responses given those media, aligned."""
    result = CliRunner().invoke(app, ["demo", "--teacher", "omni", "--steps", "10", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "of the omni teacher" in result.output
    losses = [entry["loss"] for entry in json.loads((tmp_path / "loss_full_forward_kl.json").read_text())]
    assert len(losses) == 10 and losses[-1] < 0.6 * losses[0], losses


def test_cross_tokenizer_demo_distils_a_student_with_another_tokenizer(tmp_path):
    """`--cross-tokenizer`: the student (its own tokenizer and random weights) shares no ids with
    the teacher; the loss only falls if the aligned answers reach the right student rows."""
    result = CliRunner().invoke(app, ["demo", "--cross-tokenizer", "--steps", "10", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "student tokenizer 'tiny-student', loss gold_hybrid" in result.output
    losses = [entry["loss"] for entry in json.loads((tmp_path / "loss_cross_tokenizer_gold_hybrid.json").read_text())]
    assert len(losses) == 10 and losses[-1] < 0.6 * losses[0], losses
    refused = CliRunner().invoke(app, ["demo", "--cross-tokenizer", "--loss", "k3", "--out", str(tmp_path)])
    assert refused.exit_code == 2 and "--loss with --cross-tokenizer must be one of" in refused.output


def test_demo_refuses_unknown_options(tmp_path, capsys):
    targets = {"grpc": "grpc://127.0.0.1:1", "http": "http://127.0.0.1:1"}  # never reached
    assert run_demo(targets, tmp_path, steps=2, loss="mse_logits", out=tmp_path) == 2
    assert run_demo(targets, tmp_path, steps=2, transport="carrier-pigeon", out=tmp_path) == 2
    assert run_demo(targets, tmp_path, steps=2, teacher="tiny-llama", out=tmp_path) == 2
    err = capsys.readouterr().err
    assert "--loss must be one of" in err and "--teacher must be one of" in err
    refused = CliRunner().invoke(app, ["demo", "--loss", "mse_logits", "--out", str(tmp_path)])
    assert refused.exit_code == 2 and "--loss must be one of" in refused.output


def test_builtin_png_writer_draws_the_falling_curve_over_its_band(tmp_path):
    path = tmp_path / "curve.png"
    _write_png(path, *_raster([3.0, 2.0, 1.0, 0.5], [1.0, 0.5, 0.2, 0.1], [5.0, 4.0, 2.0, 1.0]))
    with Image.open(path) as image:
        assert image.size == (480, 240) and image.mode == "RGB"
        pixels = image.convert("RGB").load()
        curve = {x: min(y for y in range(240) if pixels[x, y] == LINE)
                 for x in range(480) if any(pixels[x, y] == LINE for y in range(240))}
        band = sum(pixels[x, y] == BAND for x in range(480) for y in range(240))
    columns = sorted(curve)
    assert columns[0] <= 12 and columns[-1] >= 468, "the curve spans the plot from the first step to the last"
    heights = [curve[x] for x in columns]  # image rows grow downwards: a falling loss sinks
    assert heights == sorted(heights) and heights[-1] - heights[0] > 80, heights[:: len(heights) // 8]
    assert band > 0, "the loss_min..loss_max band is not drawn"
