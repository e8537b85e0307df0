"""The vLLM-Omni environment (.venv-omni, made by scripts/install_omni.sh) and a `proctor serve
--engine vllm_omni` running from it.

vLLM-Omni 0.30.0 cannot share the main venv (its vLLM and transformers pins differ), so the server
process runs the omni venv's Python while the test driver and the transformers reference run
here. Without that venv the omni suites skip, except under CI=true or PROCTOR_REQUIRE_OMNI=1
(.ci/run sets it after building the venv), where they fail: a missing venv there is a broken CI,
never a silent skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.servers import SubprocessServer

ROOT = Path(__file__).resolve().parents[2]
OMNI_VENV = Path(os.environ.get("PROCTOR_OMNI_VENV", ROOT / ".venv-omni"))
# The stage settings a CPU needs: a KV cache of a fixed size (vLLM's default would reserve 0.9 x
# the machine's memory), no graph capture or compilation, one worker in the stage's own process.
CPU_STAGE = {"kv_cache_memory_bytes": 128 << 20, "distributed_executor_backend": "uni"}


def omni_python() -> Path:
    """The omni venv's Python; skips without it (fails under CI=true or PROCTOR_REQUIRE_OMNI=1)."""
    python = OMNI_VENV / "bin" / "python"
    if python.exists() and (OMNI_VENV / ".installed").exists():
        return python
    why = f"{OMNI_VENV} is missing or unfinished: run scripts/install_omni.sh"
    if os.environ.get("CI", "").lower() == "true" or os.environ.get("PROCTOR_REQUIRE_OMNI") == "1":
        pytest.fail(f"CI requires the omni venv and {why}", pytrace=False)
    pytest.skip(why)


def omni_server(model_dir: Path, *, replicas: int = 1, max_model_len: int = 1024, max_topk: int = 8,
                extra: list[str] | None = None, startup_timeout: float = 900) -> SubprocessServer:
    """`proctor serve --engine vllm_omni` on the tiny Omni Thinker, from the omni venv, on the CPU
    platform of tests/omni_cpu_platform (float32, eager)."""
    import json

    kwargs = {"output_mode": "ar", "pipeline_name": "qwen2_5_omni", **CPU_STAGE}
    command = [
        str(omni_python()), "-m", "proctor.server.cli.main", "serve", "--grpc-port", "0", "--http-port", "0",
        "--engine", "vllm_omni", "--device", "cpu", "--dtype", "float32", "--model", str(model_dir),
        "--max-topk", str(max_topk), "--max-model-len", str(max_model_len), "--replicas", str(replicas),
        "--teacher-name", "omni", "--inference", "enforce_eager=true",
        "--inference", "engine_kwargs=" + json.dumps({"vllm_omni": kwargs}), *(extra or []),
    ]
    return SubprocessServer([], command=command, startup_timeout=startup_timeout)
