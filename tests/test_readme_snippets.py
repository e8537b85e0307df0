"""The README's "score -> loss -> backward" snippet runs as printed, against a real server.

The snippet is `examples/score_loss_backward.py` without its docstring: the test checks the two
are the same code, then runs the README's block (its target given on the command line, the only
thing a reader changes) in a Python of its own against the tiny teacher.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "score_loss_backward.py"


def _readme_block() -> str:
    """The first ```python block of the README's Losses section."""
    section = ROOT.joinpath("README.md").read_text().split("\n### Losses\n", 1)[1].split("\n### ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_snippet_is_the_example_file():
    code = EXAMPLE.read_text().split('"""', 2)[2].lstrip("\n")
    assert _readme_block() == code


def test_the_readme_snippet_scores_computes_losses_and_backpropagates(torch_server, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(_readme_block())
    done = subprocess.run([sys.executable, str(script), f"grpc://{torch_server.grpc_target}"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = re.findall(r"^(\S+): (\S+) nats/token, \|grad\| (\S+)$", done.stdout, re.M)
    lines = {name: (float(value), float(grad)) for name, value, grad in found}
    assert set(lines) == {"k3", "forward_kl_topk", "full_forward_kl"}, done.stdout
    for value, grad in lines.values():  # a random student is far from the teacher: KLs > 0, gradients flow
        assert math.isfinite(value) and value > 0 and grad > 0, done.stdout
