"""glibc's thresholds in a serving process: large answer buffers reused, not faulted in again.

Each case runs in a fresh interpreter (the setting is process-wide and cannot be undone): it
keeps eight answers of a few MiB alive at a time, finishing in no set order, as a front
streaming hidden states to several clients does, and counts the page faults of building 200.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHURN = """
import random, resource, sys
from proctor.server.common.malloc_tuning import keep_large_buffers
tuned = keep_large_buffers() if sys.argv[1] == "tuned" else None
rng = random.Random(0)
part = b"x" * (2 << 20)
alive = []
def answer():  # a 2, 4 or 6 MiB answer built; one of the nine alive finishes, in no set order
    alive.append(b"".join([b"head", part * rng.choice([1, 2, 3])]))
    if len(alive) > 8:
        alive.pop(rng.randrange(len(alive)))
for _ in range(20):  # warm-up
    answer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    answer()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True).stdout
    tuned, faults = out.split()
    return tuned, int(faults)


def test_answers_of_megabytes_stop_costing_page_faults_once_tuned():
    tuned, faults = _faults("tuned")
    if tuned != "True":
        pytest.skip("not glibc: the thresholds cannot be set here")
    _, untuned_faults = _faults("default")
    # Untuned, glibc maps and trims around these sizes: most answers land on fresh pages (each
    # 4 KiB page a fault). Tuned, freed answers are reused in place.
    assert untuned_faults > 200 * 64
    assert faults < untuned_faults / 8
