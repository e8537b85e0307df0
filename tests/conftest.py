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
