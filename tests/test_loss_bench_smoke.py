"""The loss benchmark runs end to end in its --quick mode and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "loss_bench.py"


def test_quick_bench_prints_a_row_per_variant():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label in ("(a) dense", "(b) teacher chunked", "(c) fully fused", "(d) Liger-Kernel"):
        assert label in out
    fused = next(line for line in out.splitlines() if line.startswith("(c) fully fused"))
    # The fused result was checked against the dense one, and agrees.
    rel = float(fused.split("loss rel")[1].split(",")[0])
    assert rel < 1e-4
