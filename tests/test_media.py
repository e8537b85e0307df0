"""Wire media → vLLM multi_modal_data: images, WAV audio, npy arrays, video, and clear errors."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from proctor.server.engines.base import MediaItem, MultiModalInputs
from proctor.server.engines.media import decode_audio, decode_image, decode_video, multi_modal_data


def _png(size=(6, 4), color=(10, 200, 30), fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def _wav(samples: np.ndarray, rate: int = 8000, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as handle:
        handle.setnchannels(channels)
        handle.setsampwidth(width)
        handle.setframerate(rate)
        handle.writeframes((samples * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_png_and_jpeg_become_rgb_pil_images():
    image = decode_image(MediaItem(_png(), "image/png"))
    assert image.size == (6, 4) and image.mode == "RGB" and image.getpixel((0, 0)) == (10, 200, 30)
    jpeg = decode_image(MediaItem(_png(fmt="JPEG"), "image/jpeg"))
    assert jpeg.size == (6, 4)


def test_wav_becomes_float_samples_and_rate():
    tone = np.sin(np.linspace(0, 20, 800)).astype(np.float32) * 0.5
    samples, rate = decode_audio(MediaItem(_wav(tone), "audio/wav"))
    assert rate == 8000 and samples.dtype == np.float32 and samples.shape == (800,)
    np.testing.assert_allclose(samples, tone, atol=1e-4)


def test_stereo_wav_is_mixed_to_mono():
    left = np.full(10, 0.5, np.float32)
    stereo = np.stack([left, -left], axis=1).reshape(-1)
    samples, _ = decode_audio(MediaItem(_wav(stereo, channels=2), "audio/x-wav"))
    np.testing.assert_allclose(samples, 0.0, atol=1e-4)


def test_npy_arrays_for_audio_image_and_video():
    wave_ = np.linspace(-1, 1, 50, dtype=np.float32)
    samples, rate = decode_audio(MediaItem(_npy(wave_), "application/x-npy"), sample_rate=24000)
    assert rate == 24000 and np.array_equal(samples, wave_)
    image = decode_image(MediaItem(_npy(np.zeros((3, 5, 3), np.uint8)), "application/x-npy"))
    assert image.size == (5, 3)
    frames = np.zeros((2, 4, 4, 3), np.uint8)
    assert np.array_equal(decode_video(MediaItem(_npy(frames), "video/x-npy")), frames)


def test_mp4_video_decodes_to_frames_and_metadata(tmp_path):
    cv2 = pytest.importorskip("cv2")
    path = str(tmp_path / "v.avi")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 5.0, (16, 8))
    for _ in range(3):
        writer.write(np.full((8, 16, 3), 120, np.uint8))
    writer.release()
    with open(path, "rb") as handle:
        frames, meta = decode_video(MediaItem(handle.read(), "video/x-msvideo"))
    assert frames.shape == (3, 8, 16, 3) and meta["total_num_frames"] == 3 and meta["fps"] == pytest.approx(5.0)


def test_multi_modal_data_keeps_order_and_uses_vllm_keys():
    media = MultiModalInputs(
        images=(MediaItem(_png((2, 2)), "image/png"), MediaItem(_png((3, 3)), "image/png")),
        audios=(MediaItem(_npy(np.zeros(4, np.float32)), "application/x-npy"),),
        processor_kwargs={"sampling_rate": 16000},
    )
    data = multi_modal_data(media)
    assert set(data) == {"image", "audio"}
    assert [im.size for im in data["image"]] == [(2, 2), (3, 3)]
    assert data["audio"][0][1] == 16000
    assert multi_modal_data(None) == {} and multi_modal_data(MultiModalInputs()) == {}


@pytest.mark.parametrize(
    ("media", "message"),
    [
        (MultiModalInputs(images=(MediaItem(b"not a png", "image/png"),)), r"images\[0\].*cannot decode"),
        (MultiModalInputs(images=(MediaItem(_png(), "text/plain"),)), r"images\[0\].*not an image type"),
        (MultiModalInputs(audios=(MediaItem(b"RIFFjunk", "audio/wav"),)), r"audios\[0\].*WAV"),
        (MultiModalInputs(audios=(MediaItem(b"x", "image/png"),)), r"audios\[0\].*not an audio type"),
        (MultiModalInputs(videos=(MediaItem(b"x", "application/x-npy"),)), r"videos\[0\].*npy"),
        (MultiModalInputs(videos=(MediaItem(_npy(np.zeros((2, 2))), "video/x-npy"),)), r"videos\[0\].*\[T, H, W, C\]"),
        (
            MultiModalInputs(images=(MediaItem(_png(), "image/png"), MediaItem(b"", "image/jpeg"))),
            r"images\[1\]",
        ),
    ],
)
def test_bad_media_names_the_field(media, message):
    with pytest.raises(ValueError, match=message):
        multi_modal_data(media)
