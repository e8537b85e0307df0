"""The drain tests' server: tests/drain_server.py (a delayed real engine serving until SIGTERM) in
its own process, started as `proctor serve` is (support.servers.SubprocessServer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.servers import SubprocessServer

SCRIPT = Path(__file__).resolve().parents[1] / "drain_server.py"


def start_drain_server(model_dir: Path, delay: float, grace: float = 30.0) -> tuple[subprocess.Popen, str, str]:
    """(process, gRPC target, HTTP URL) of a drain server whose engine answers after `delay` s per
    batch, once its engine is ready."""
    server = SubprocessServer([], command=[sys.executable, str(SCRIPT), str(model_dir), str(delay), str(grace)])
    return server.proc, server.grpc_target, server.http_url
