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
    for label in ("(a) dense", "(b) teacher chunked", "(c) fully fused, per-token", "(d) fully fused, reduced",
                  "(e) Liger-Kernel", "(f) Liger-Kernel", "(g) cut-cross-entropy"):
        assert label in out
    for prefix, work in (("(c) fully fused", 6.0), ("(d) fully fused", 4.0), ("(a) dense", 4.0)):
        line = next(line for line in out.splitlines() if line.startswith(prefix))
        cols = line[40:].split()
        # The matmul-work column: the machine-independent figure.
        assert float(cols[7]) == work, line
        if prefix != "(a) dense":
            # The fused results were checked against the dense one, and agree.
            rel = float(line.split("loss rel")[1].split(",")[0])
            assert rel < 1e-4
