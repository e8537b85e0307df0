"""Multimodal samples as the wire carries them, and their independent transformers reference.

A sample is a prompt text with one placeholder per media item, the media encoded as a rollout
would send them (PNG, JPEG, WAV, MP4, .npy frames), and a response. The reference decodes the
bytes itself (PIL, `wave`, OpenCV, numpy: not through proctor's decoder), runs the model
directory's own processor on text + media (the token ids the rollout sends are its output),
and one full forward of the transformers model: every position's log-softmax and the last
layer's hidden states.
"""

from __future__ import annotations

import io
import tempfile
import wave
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import torch

from proctor.client import Media
from proctor.client.media_files import png_media, wav_media
from proctor.server.engines.torch.loading import build


@dataclass
class Sample:
    """One multimodal sequence: text with placeholders, encoded media, the decoded media."""

    text: str
    images: list[Media] = field(default_factory=list)
    videos: list[Media] = field(default_factory=list)
    audios: list[Media] = field(default_factory=list)

    def media(self) -> dict[str, list[Media]]:
        return {"images": self.images, "videos": self.videos, "audios": self.audios}


png = png_media  # the client's encoders; decoding below is the test's own
def jpeg(array: np.ndarray) -> Media:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=90)
    return Media(buffer.getvalue(), "image/jpeg")


wav = wav_media


def npy(array: np.ndarray, media_type: str = "video/x-npy") -> Media:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return Media(buffer.getvalue(), media_type)


def mp4(frames: np.ndarray, fps: float = 4.0) -> Media:
    import cv2

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "clip.mp4")
        height, width = frames.shape[1:3]
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        for frame in frames:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        return Media(Path(path).read_bytes(), "video/mp4")


def decode(item: Media, kind: str):
    """The test's own decoding of an encoded item (what the processor is given)."""
    if item.media_type.startswith("image/"):
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(item.data)).convert("RGB"))
    if item.media_type == "audio/wav":
        with wave.open(io.BytesIO(item.data)) as handle:
            return np.frombuffer(handle.readframes(handle.getnframes()), "<i2").astype(np.float32) / 32768.0
    if item.media_type == "video/mp4":
        import cv2

        with tempfile.TemporaryDirectory() as folder:
            path = str(Path(folder) / "clip.mp4")
            Path(path).write_bytes(item.data)
            capture, frames = cv2.VideoCapture(path), []
            while capture.grab():  # frame by frame, BGR as OpenCV decodes it, flipped to RGB
                frames.append(capture.retrieve()[1][..., ::-1])
            capture.release()
        return np.ascontiguousarray(np.stack(frames))
    return np.load(io.BytesIO(item.data), allow_pickle=False)


def noise_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def smooth_image(height: int, width: int) -> np.ndarray:
    """A gradient: JPEG keeps it close, and any decoder gives the same pixels for the same bytes."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), (x + y) % 256], -1).astype(np.uint8)


def tone(seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.sin(2 * np.pi * 97 * t)).astype(np.float32)


@dataclass
class Reference:
    """The processor's token ids and the model's full forward on them."""

    ids: list[int]
    logprobs: torch.Tensor  # [T - 1, V]: row j is the distribution of token j + 1
    hidden: torch.Tensor  # [T, H], the last layer's normed states


@cache
def _model_and_processor(model_dir: str):
    import transformers
    from transformers import AutoConfig, AutoProcessor

    config = AutoConfig.from_pretrained(model_dir)
    architecture = config.architectures[0]
    if "Omni" in architecture:
        model = build(getattr(transformers, architecture).from_pretrained, model_dir, dtype=torch.float32).thinker
    else:
        model = build(transformers.AutoModelForImageTextToText.from_pretrained, model_dir, dtype=torch.float32)
    return model.eval(), AutoProcessor.from_pretrained(model_dir)


def processor_of(model_dir: str | Path):
    return _model_and_processor(str(model_dir))[1]


def reference(model_dir: str | Path, sample: Sample, response: str = " 12 times 7 is 84.") -> Reference:
    model, processor = _model_and_processor(str(model_dir))
    arguments = {}
    if sample.images:
        arguments["images"] = [decode(item, "images") for item in sample.images]
    if sample.videos:
        arguments["videos"] = [decode(item, "videos") for item in sample.videos]
    if sample.audios:
        arguments["audio"] = [decode(item, "audios") for item in sample.audios]
        arguments["sampling_rate"] = 16000
    inputs = processor(text=[sample.text + response], return_tensors="pt", **arguments)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    logp = torch.log_softmax(out.logits[0].double(), -1)[:-1].float()
    return Reference(inputs["input_ids"][0].tolist(), logp, out.hidden_states[-1][0].float())


def assert_scores_match(scores, ref: Reference, *, topk: int, atol: float = 1e-4) -> None:
    """Log-probs, top-k (ids equal) and, when present, hidden states against the reference."""
    first = scores.first_row
    ids = torch.tensor(ref.ids)
    rows = ref.logprobs[first - 1 :]
    want = rows.gather(1, ids[first:, None])[:, 0]
    torch.testing.assert_close(scores.logprobs, want, atol=atol, rtol=0)
    if topk:
        values, top = rows.topk(topk, dim=-1)
        assert torch.equal(scores.topk_ids.long(), top), "top-k ids differ from the reference"
        torch.testing.assert_close(scores.topk_logprobs, values, atol=atol, rtol=0)
    if scores.hidden_states is not None:
        torch.testing.assert_close(scores.hidden_states.float(), ref.hidden[first - 1 : -1], atol=atol, rtol=0)


def assert_http_score_matches(http_url: str, model_dir: str | Path, sample: Sample, *, topk: int) -> None:
    """The sample scored through the HTTP JSON surface (/v1/score, media base64): its log-probs
    equal the reference at 1e-4."""
    import base64

    import httpx

    ref = reference(model_dir, sample)
    body = {"token_ids": ref.ids, "topk": topk}
    for kind, items in sample.media().items():
        body[kind] = [{"data": base64.b64encode(item.data).decode(), "media_type": item.media_type} for item in items]
    answer = httpx.post(http_url + "/v1/score", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    logprobs = torch.tensor([x for x in answer.json()["logprobs"] if x is not None])
    want = ref.logprobs.gather(1, torch.tensor(ref.ids)[1:, None])[:, 0]
    torch.testing.assert_close(logprobs, want, atol=1e-4, rtol=0)
