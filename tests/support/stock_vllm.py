"""Stock vLLM's own OpenAI-compatible server on a loopback port, beside proctor: benchmarks and
tests send it the identical request they send proctor (same model, dtype and memory)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from support.servers import free_port


class StockServer:
    """`python -m vllm.entrypoints.openai.api_server` on the model, started and waited for."""

    def __init__(self, model: Path, memory: float, max_len: int, *, max_logprobs: int = 64,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None, startup_s: float = 600) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
             "--max-model-len", str(max_len), "--gpu-memory-utilization", str(memory), "--max-logprobs",
             str(max_logprobs), "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("stock vLLM server exited during startup")
            time.sleep(1)
        self.stop()
        raise TimeoutError("stock vLLM server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
