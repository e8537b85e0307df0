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
INVALID_ARGUMENT. `decode_media` is what the service calls, before admission and off the event
loop: it decodes every item once under `MediaLimits` (bytes per item, items per request, image
pixels, video frames, audio seconds), so an undecodable or oversized item never reaches a
replica and engines receive `MultiModalInputs.decoded` instead of bytes.

A media type may carry parameters: `application/x-npy; rate=24000` gives a decoded waveform
its sample rate (what verl's `(waveform, rate)` audio items become on the wire).
"""

from __future__ import annotations

import io
import os
import tempfile
import wave
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from proctor.server.engines.base import MediaItem, MultiModalInputs

NPY_TYPES = ("application/x-npy", "application/npy", "image/x-npy", "audio/x-npy", "video/x-npy")
WAV_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave")
DEFAULT_SAMPLE_RATE = 16000
# multi_modal_data keys, by the wire field they come from.
MM_KEYS = {"images": "image", "audios": "audio", "videos": "video"}


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one request's media, checked while decoding (before a replica sees it)."""

    max_item_bytes: int = 64 << 20
    max_items: int = 64
    max_image_pixels: int = 64_000_000  # about 8000 x 8000
    max_video_frames: int = 2048
    max_audio_seconds: float = 3600.0


def _base_type(media_type: str) -> str:
    return media_type.split(";", 1)[0].strip().lower()


def media_type_param(media_type: str, name: str) -> str | None:
    """A parameter of a media type (`rate` of `application/x-npy; rate=16000`), or None."""
    for part in media_type.split(";")[1:]:
        key, sep, value = part.partition("=")
        if sep and key.strip().lower() == name:
            return value.strip().strip('"')
    return None


def _sample_rate(item: MediaItem, field: str, fallback: int | None) -> int:
    given = media_type_param(item.media_type, "rate")
    if given is None:
        return int(fallback or DEFAULT_SAMPLE_RATE)
    if not given.isdigit() or not 0 < int(given) <= 1_000_000:
        raise ValueError(f"{field}: media type parameter rate={given!r} is not a sample rate in Hz")
    return int(given)


def _load_npy(data: bytes, field: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:
        raise ValueError(f"{field}: not a readable .npy array ({exc})") from exc


def _npy_media(data: bytes, field: str, ndims: tuple[int, ...], shape: str, what: str) -> np.ndarray:
    """A media item sent as a .npy array, checked for the one thing every decoder needs: numbers
    of a shape the model's processor takes (`what` must be `shape`)."""
    array = _load_npy(data, field)
    if array.ndim not in ndims:
        raise ValueError(f"{field}: {what} must be {shape}, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"{field}: {what} must be numeric, got dtype {array.dtype}")
    return array


def decode_image(item: MediaItem, field: str = "images[0]"):
    kind = _base_type(item.media_type)
    if kind in NPY_TYPES:
        from PIL import Image

        array = _npy_media(item.data, field, (2, 3), "[H, W] or [H, W, C]", "an image array")
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
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
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
        array = _npy_media(item.data, field, (1,), "1-D (mono samples)", "an audio array")
        return array.astype(np.float32), _sample_rate(item, field, sample_rate)
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
        return _npy_media(item.data, field, (4,), "[T, H, W, C]", "video frames")
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


def _check_decoded(kind: str, value: Any, field: str, limits: MediaLimits) -> None:
    """Refuse a decoded item past the limits (pixels, frames, seconds)."""
    if kind == "images":
        width, height = value.size
        if width * height > limits.max_image_pixels:
            raise ValueError(f"{field}: {width}x{height} pixels exceed the limit of {limits.max_image_pixels}")
        if width == 0 or height == 0:
            raise ValueError(f"{field}: the image is empty ({width}x{height})")
    elif kind == "videos":
        frames = value[0] if isinstance(value, tuple) else value
        if frames.shape[0] > limits.max_video_frames:
            raise ValueError(f"{field}: {frames.shape[0]} frames exceed the limit of {limits.max_video_frames}")
        if 0 in frames.shape:
            raise ValueError(f"{field}: the video is empty (frames of shape {tuple(frames.shape)})")
    else:
        samples, rate = value
        if samples.size == 0:
            raise ValueError(f"{field}: the audio clip is empty")
        if samples.size / rate > limits.max_audio_seconds:
            raise ValueError(
                f"{field}: {samples.size / rate:.0f} s of audio exceed the limit of {limits.max_audio_seconds:.0f} s"
            )
        if not np.isfinite(samples).all():
            raise ValueError(f"{field}: the audio clip holds NaN or infinite samples")


def decode_media(media: MultiModalInputs, limits: MediaLimits | None = None) -> MultiModalInputs:
    """`media` with `decoded` filled (vLLM's multi_modal_data form), every item checked.

    Raises ValueError naming the item (`images[1]: ...`). An image's pixel count is checked
    from its header before its pixels load, so a decompression bomb costs nothing.
    """
    limits = limits or MediaLimits()
    count = len(media.images) + len(media.videos) + len(media.audios)
    if count > limits.max_items:
        raise ValueError(f"{media.kinds()[0]}: {count} media items exceed the limit of {limits.max_items}")
    for kind in ("images", "videos", "audios"):
        for index, item in enumerate(getattr(media, kind)):
            if len(item.data) > limits.max_item_bytes:
                raise ValueError(
                    f"{kind}[{index}]: {len(item.data)} bytes exceed the limit of {limits.max_item_bytes}"
                )
            if kind == "images" and _base_type(item.media_type) not in NPY_TYPES:
                _check_image_header(item, f"{kind}[{index}]", limits)
    decoded = multi_modal_data(media)
    for kind, key in MM_KEYS.items():
        for index, value in enumerate(decoded.get(key, ())):
            _check_decoded(kind, value, f"{kind}[{index}]", limits)
    return replace(media, decoded=decoded)


def _check_image_header(item: MediaItem, field: str, limits: MediaLimits) -> None:
    """The pixel count from the image header, before decoding a possible decompression bomb."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(item.data)) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{field}: cannot decode {item.media_type} bytes ({exc})") from exc
    if width * height > limits.max_image_pixels:
        raise ValueError(f"{field}: {width}x{height} pixels exceed the limit of {limits.max_image_pixels}")
