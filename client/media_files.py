"""Media items encoded as files, for trainers that hold decoded media: RGB pixels as PNG, a mono
waveform as 16-bit PCM WAV. Lossless for pixels; for audio it is the PCM the server decodes, so
a trainer that keeps the decoded clip (`wav_samples`) sees exactly what the teacher sees."""

from __future__ import annotations

import io
import wave

import numpy as np

from proctor.client.transports import Media


def png_media(pixels: np.ndarray) -> Media:
    """uint8 [H, W, 3] pixels as an image/png item."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return Media(buffer.getvalue(), "image/png")


def wav_media(samples: np.ndarray, rate: int) -> Media:
    """A float waveform in [-1, 1] as a mono 16-bit audio/wav item at `rate` Hz."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return Media(buffer.getvalue(), "audio/wav")


def wav_samples(media: Media) -> np.ndarray:
    """The float32 waveform of a 16-bit PCM WAV item, as the server decodes it."""
    with wave.open(io.BytesIO(media.data)) as handle:
        return np.frombuffer(handle.readframes(handle.getnframes()), "<i2").astype(np.float32) / 32768.0
