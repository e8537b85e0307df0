"""The placeholder rule on its own (server/engines/multimodal.py), and the tiny-model command."""

from __future__ import annotations

import json

import numpy as np
import torch
from typer.testing import CliRunner

from proctor.server.cli.main import app
from proctor.server.engines.base import EngineRequest, MediaItem, MultiModalInputs, RequestRejected
from proctor.server.engines.multimodal import (
    Placeholders,
    check_counts,
    check_runs,
    collapse_runs,
    run_lengths,
    runs,
)

P = Placeholders({"images": 9, "audios": 8}, audio_rate=16000)


def _request(ids, *, images=0, audio_rates=()):
    media = MultiModalInputs(
        images=tuple(MediaItem(b"x", "image/png") for _ in range(images)),
        audios=tuple(MediaItem(b"x", "audio/wav") for _ in audio_rates),
        decoded={"image": [None] * images, "audio": [(np.zeros(4, np.float32), r) for r in audio_rates]},
    )
    return EngineRequest("r", torch.tensor(ids), 1, True, 0, False, media=media)


def test_runs_and_collapse_keep_adjacent_items_of_other_kinds_apart():
    ids = np.array([1, 9, 9, 9, 2, 9, 8, 8, 3])
    assert runs(ids, 9) == [(1, 3), (5, 1)]
    assert collapse_runs(ids, P) == [1, 9, 2, 9, 8, 3]
    assert run_lengths([9, 9, 4, 9, 8, 8, 8], P, ["images", "audios"]) == {"images": [2, 1], "audios": [3]}


def test_counts_lengths_and_audio_rate_are_each_the_requests_error():
    assert check_counts(_request([1, 9, 9, 2, 9, 3], images=2), P) is None
    too_many = check_counts(_request([1, 9, 2, 9, 3, 9], images=2), P)
    assert isinstance(too_many, RequestRejected) and too_many.field == "token_ids" and "3 images" in too_many.message
    length = check_runs(_request([1, 9, 9, 2, 9, 3], images=2), P, {"images": [2, 4]})
    assert isinstance(length, RequestRejected) and length.field == "images[1]" and "has 1 tokens" in length.message
    rate = check_counts(_request([1, 8, 8, 3], audio_rates=(8000,)), P)
    assert isinstance(rate, RequestRejected) and rate.field == "audios[0]" and "16000 Hz" in rate.message
    video = check_counts(EngineRequest("v", torch.tensor([1, 2]), 1, True, 0, False,
                                       media=MultiModalInputs(videos=(MediaItem(b"x", "video/mp4"),))), P)
    assert isinstance(video, RequestRejected) and video.field == "videos[0]"


def test_placeholders_come_from_the_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 5}))
    assert Placeholders.of_model(tmp_path).kinds == ()  # a text model: its engines refuse media
    omni = {"thinker_config": {"vision_config": {}, "audio_config": {}, "image_token_index": 5,
                               "video_token_index": 6, "audio_token_index": 7}}
    (tmp_path / "config.json").write_text(json.dumps(omni))
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": {"sampling_rate": 24000}}))
    found = Placeholders.of_model(tmp_path)
    assert found.token_ids == {"images": 5, "videos": 6, "audios": 7} and found.audio_rate == 24000


def test_make_tiny_model_kind_vl_writes_a_checkpoint_with_its_processor(tmp_path):
    from transformers import AutoProcessor

    result = CliRunner().invoke(app, ["make-tiny-model", str(tmp_path / "vl"), "--kind", "vl"])
    assert result.exit_code == 0, result.output
    processor = AutoProcessor.from_pretrained(tmp_path / "vl")
    assert Placeholders.of_model(tmp_path / "vl").token_ids["images"] == processor.tokenizer.convert_tokens_to_ids(
        processor.image_token)
    refused = CliRunner().invoke(app, ["make-tiny-model", str(tmp_path / "x"), "--kind", "llava"])
    assert refused.exit_code != 0 and "--kind must be one of" in refused.output
