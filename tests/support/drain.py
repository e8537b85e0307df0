"""The drain tests' server: tests/drain_server.py (a delayed real engine serving until SIGTERM) in
its own process, started and waited for once here."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

SCRIPT = Path(__file__).resolve().parents[1] / "drain_server.py"


def start_drain_server(model_dir: Path, delay: float, grace: float = 30.0) -> tuple[subprocess.Popen, str, str]:
    """(process, gRPC target, HTTP URL) of a drain server whose engine answers after `delay` s per
    batch, once its engine is ready; its output is read (and dropped) by a thread."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(model_dir), str(delay), str(grace)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=SCRIPT.parent)
    line = ""
    while "gRPC on" not in line:
        line = proc.stdout.readline()
        assert line, "drain server died at startup"
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    match = re.search(r"gRPC on (\S+), HTTP on (\S+)", line)
    url = f"http://{match.group(2)}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return proc, match.group(1), url
