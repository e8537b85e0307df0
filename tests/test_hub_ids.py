"""A Hugging Face id as `model_path` / `--model`, resolved as vLLM resolves it: its snapshot in the
hub cache (downloaded there unless HF_HUB_OFFLINE=1). Offline here, on a hub-cache layout made
locally (`models--org--name/snapshots/<rev>/...`, `refs/main`) under a HF_HUB_CACHE of the test's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import grpc
import pytest

from proctor.proto import decode_tensor, scoring_pb2, scoring_pb2_grpc

from support.reference import assert_matches_reference
from support.servers import SubprocessServer

REVISION = "0123456789abcdef0123456789abcdef01234567"
IDS = [5, 17, 99, 4, 250, 31]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model_dir):
    """A hub cache holding `tiny-org/tiny-teacher` (the tiny teacher) and nothing else."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--tiny-org--tiny-teacher"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    """The environment of the commands: that cache, offline (the subprocesses inherit it)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def test_serve_resolves_an_id_from_the_hub_cache_offline(offline_hub, tiny_model_dir):
    server = SubprocessServer(["--model", "tiny-org/tiny-teacher", "--no-verbose"])
    try:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = scoring_pb2_grpc.TeacherScoringStub(channel)
            reply = stub.Score(scoring_pb2.ScoreRequest(token_ids=IDS, logprobs=True), timeout=60)
            info = stub.ListTeachers(scoring_pb2.TeachersRequest(), timeout=60).teachers[0]
    finally:
        server.stop()
    assert_matches_reference(decode_tensor(reply.logprobs), tiny_model_dir, IDS, atol=1e-5)
    assert info.tokenizer_fingerprint  # the front read the snapshot's tokenizer, not the id


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proctor.server.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())


def test_an_id_not_in_the_cache_offline_is_one_line_naming_hf_download(offline_hub):
    done = _run("serve", "--grpc-port", "0", "--http-port", "0", "--model", "tiny-org/absent")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "`hf download tiny-org/absent`" in line and "HF_HUB_OFFLINE=1" in line and "huggingface-cli" not in line


def test_check_config_shows_where_an_id_resolves(offline_hub, tmp_path):
    config = tmp_path / "hub.yaml"
    config.write_text("distillation:\n  n_gpus_per_node: 1\n  nnodes: 1\n  teacher_models:\n    t:\n"
                      "      model_path: tiny-org/tiny-teacher\n      inference: {name: torch, tensor_model_parallel_size: 1}\n"
                      "server: {device: cpu}\n")
    done = _run("check-config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    snapshot = offline_hub / "models--tiny-org--tiny-teacher" / "snapshots" / REVISION
    assert f"model {snapshot}" in done.stdout
    assert f"model_path tiny-org/tiny-teacher is the hub cache's {snapshot}" in done.stdout
