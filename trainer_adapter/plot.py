"""The demo's loss plot: matplotlib (Agg) when installed, else a small PNG drawn by hand.

The fallback needs nothing beyond zlib, so `proctor demo` leaves a picture on any install;
it draws the mean loss as a line over a light band from loss_min to loss_max.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path


def plot_losses(path: Path, losses: list[float], lows: list[float], highs: list[float], title: str, *,
                unit: str = "nats per token") -> str:
    """Write the curve to `path`, its y axis in `unit`; returns which writer drew it
    ("matplotlib" or "builtin": the fallback draws no text)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        _write_png(path, *_raster(losses, lows, highs))
        return "builtin"
    steps = list(range(1, len(losses) + 1))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.fill_between(steps, lows, highs, alpha=0.2, label="per-token min..max")
    ax.plot(steps, losses, marker="o", markersize=3, label="distillation/loss (token mean)")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 1.5
    ax.set_ylabel(f"loss ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def _raster(losses: list[float], lows: list[float], highs: list[float], width: int = 480, height: int = 240):
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    finite = [v for v in (*losses, *lows, *highs) if math.isfinite(v)] or [0.0, 1.0]
    top, bottom = max(finite), min(min(finite), 0.0)
    span = (top - bottom) or 1.0
    margin = 10

    def xy(i: int, value: float) -> tuple[int, int]:
        x = margin + round(i * (width - 2 * margin) / max(1, len(losses) - 1))
        y = height - margin - round((value - bottom) * (height - 2 * margin) / span)
        return min(width - 1, max(0, x)), min(height - 1, max(0, y))

    for i in range(len(losses)):  # band
        x, y_hi = xy(i, highs[i])
        _, y_lo = xy(i, lows[i])
        for y in range(min(y_hi, y_lo), max(y_hi, y_lo) + 1):
            pixels[y][x] = (200, 220, 245)
    for i in range(1, len(losses)):  # line
        (x0, y0), (x1, y1) = xy(i - 1, losses[i - 1]), xy(i, losses[i])
        for t in range(max(abs(x1 - x0), abs(y1 - y0)) + 1):
            f = t / max(1, max(abs(x1 - x0), abs(y1 - y0)))
            pixels[round(y0 + f * (y1 - y0))][round(x0 + f * (x1 - x0))] = (30, 90, 200)
    for x in range(width):  # axis at zero
        pixels[xy(0, 0.0)[1]][x] = (120, 120, 120)
    return width, height, pixels


def _write_png(path: Path, width: int, height: int, pixels) -> None:
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                     + chunk(b"IEND", b""))
