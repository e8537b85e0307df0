"""Decoding wire media (`MediaItem(data, media_type)`) into what vLLM's processors take.

`multi_modal_data(media)` returns the dict a vLLM prompt carries (`{"image": [...], "audio":
[...], "video": [...]}`), each item decoded once, in the order the rollout sent it:

- images: `image/png`, `image/jpeg`, `image/webp`, ... → `PIL.Image.Image` (RGB);
- audio: `audio/wav` (`audio/x-wav`, `audio/wave`) → `(float32 mono array in [-1, 1], sample_rate)`
  with the stdlib `wave` module (PCM 8/16/24/32-bit), or any format soundfile reads when it is
  installed (`audio/flac`, `audio/ogg`);
- video: `video/mp4`, `video/webm`, ... → `(frames uint8 [T, H, W, 3] RGB, metadata)` decoded with
  OpenCV (what vLLM's own video loader returns), or already-decoded frames as
  `application/x-npy` / `video/x-npy` → the numpy array itself;
- `application/x-npy` for images and audio too: an image array [H, W, C], an audio waveform
  (sample rate from the processor kwargs' `sampling_rate`, else 16 kHz).

Bad input raises ValueError naming the field (`images[1]: ...`), which the service reports as
INVALID_ARGUMENT.
"""

from __future__ import annotations

import io
import os
import tempfile
import wave
from collections.abc import Sequence
from typing import Any

import numpy as np

from proctor.server.engines.base import MediaItem, MultiModalInputs

NPY_TYPES = ("application/x-npy", "application/npy", "image/x-npy", "audio/x-npy", "video/x-npy")
WAV_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave")
DEFAULT_SAMPLE_RATE = 16000
# multi_modal_data keys, by the wire field they come from.
MM_KEYS = {"images": "image", "audios": "audio", "videos": "video"}


def _base_type(media_type: str) -> str:
    return media_type.split(";", 1)[0].strip().lower()


def _load_npy(data: bytes, field: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:
        raise ValueError(f"{field}: not a readable .npy array ({exc})") from exc


def decode_image(item: MediaItem, field: str = "images[0]"):
    kind = _base_type(item.media_type)
    if kind in NPY_TYPES:
        from PIL import Image

        array = _load_npy(item.data, field)
        if array.ndim not in (2, 3):
            raise ValueError(f"{field}: an image array must be [H, W] or [H, W, C], got shape {array.shape}")
        try:
            return Image.fromarray(np.ascontiguousarray(array.astype(np.uint8) if array.dtype != np.uint8 else array))
        except Exception as exc:
            raise ValueError(f"{field}: cannot make an image of an array of shape {array.shape}") from exc
    if not kind.startswith("image/"):
        raise ValueError(f"{field}: media type {item.media_type!r} is not an image type (image/png, image/jpeg, ...)")
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(item.data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"{field}: cannot decode {item.media_type} bytes ({exc})") from exc
    return image.convert("RGB") if image.mode != "RGB" else image


def _read_wav(data: bytes, field: str) -> tuple[np.ndarray, int]:
    try:
        with wave.open(io.BytesIO(data), "rb") as handle:
            rate = handle.getframerate()
            channels = handle.getnchannels()
            width = handle.getsampwidth()
            frames = handle.readframes(handle.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{field}: cannot decode WAV bytes ({exc})") from exc
    if width == 1:
        samples = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3)
        ints = (raw[:, 0].astype(np.int32) | (raw[:, 1].astype(np.int32) << 8) | (raw[:, 2].astype(np.int32) << 16))
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        samples = ints.astype(np.float32) / float(1 << 23)
    elif width == 4:
        samples = np.frombuffer(frames, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise ValueError(f"{field}: unsupported WAV sample width {width} bytes")
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    return samples.astype(np.float32), int(rate)


def decode_audio(item: MediaItem, field: str = "audios[0]", sample_rate: int | None = None) -> tuple[np.ndarray, int]:
    kind = _base_type(item.media_type)
    if kind in NPY_TYPES:
        array = _load_npy(item.data, field)
        if array.ndim != 1:
            raise ValueError(f"{field}: an audio array must be 1-D (mono samples), got shape {array.shape}")
        return array.astype(np.float32), int(sample_rate or DEFAULT_SAMPLE_RATE)
    if kind in WAV_TYPES:
        try:
            return _read_wav(item.data, field)
        except ValueError:
            if not _has_soundfile():
                raise
    if not kind.startswith("audio/"):
        raise ValueError(f"{field}: media type {item.media_type!r} is not an audio type (audio/wav, ...)")
    if not _has_soundfile():
        raise ValueError(
            f"{field}: media type {item.media_type!r} needs soundfile (pip install soundfile); "
            "send audio/wav or application/x-npy instead"
        )
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(item.data), dtype="float32", always_2d=False)
    except Exception as exc:
        raise ValueError(f"{field}: cannot decode {item.media_type} bytes ({exc})") from exc
    if samples.ndim > 1:
        samples = samples.mean(axis=1)
    return samples.astype(np.float32), int(rate)


def _has_soundfile() -> bool:
    try:
        import soundfile  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def decode_video(item: MediaItem, field: str = "videos[0]"):
    kind = _base_type(item.media_type)
    if kind in NPY_TYPES:
        array = _load_npy(item.data, field)
        if array.ndim != 4:
            raise ValueError(f"{field}: video frames must be [T, H, W, C], got shape {array.shape}")
        return array
    if not kind.startswith("video/"):
        raise ValueError(f"{field}: media type {item.media_type!r} is not a video type (video/mp4, ...)")
    try:
        import cv2
    except ImportError as exc:
        raise ValueError(
            f"{field}: decoding {item.media_type} needs OpenCV (pip install opencv-python-headless); "
            "or send decoded frames as application/x-npy"
        ) from exc
    suffix = "." + kind.split("/", 1)[1].split("+", 1)[0]
    fd, path = tempfile.mkstemp(suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(item.data)
        capture = cv2.VideoCapture(path)
        fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0)
        frames = []
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        capture.release()
    finally:
        os.unlink(path)
    if not frames:
        raise ValueError(f"{field}: cannot decode {item.media_type} bytes (no frames)")
    array = np.stack(frames)
    metadata = {
        "total_num_frames": len(frames),
        "fps": fps,
        "duration": len(frames) / fps if fps else 0.0,
        "video_backend": "opencv",
        "frames_indices": list(range(len(frames))),
    }
    return array, metadata


def multi_modal_data(media: MultiModalInputs | None) -> dict[str, Any]:
    """vLLM's `multi_modal_data` for a request's media (empty dict when there is none).

    Every item becomes one list entry, so a prompt with one image still gets `{"image": [img]}`
    (vLLM takes lists for any count).
    """
    if not media:
        return {}
    rate = (media.processor_kwargs or {}).get("sampling_rate")
    out: dict[str, Any] = {}
    decoders = {"images": decode_image, "videos": decode_video}
    for field in ("images", "audios", "videos"):
        items: Sequence[MediaItem] = getattr(media, field)
        if not items:
            continue
        decoded = []
        for index, item in enumerate(items):
            name = f"{field}[{index}]"
            if field == "audios":
                decoded.append(decode_audio(item, name, sample_rate=rate))
            else:
                decoded.append(decoders[field](item, name))
        out[MM_KEYS[field]] = decoded
    return out
