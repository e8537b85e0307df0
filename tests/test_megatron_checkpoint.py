"""A teacher straight from a Megatron training run (`dist_ckpt_path`), through a real server.

The checkpoints are written here by megatron-core's own dist_checkpointing (CPU, gloo): one
saved at TP 1, one saved at TP 2 by two ranks (read back whole: the re-shard). The served
teacher's `model_path` is the tiny teacher, while the checkpoints hold another seed's weights:
scores must be those other weights' (the float64 reference of that folder), never model_path's.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

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


def _write_checkpoint(hf_dir: Path, ckpt: Path, step: int, tp: int) -> Path:
    """megatron-core saves `hf_dir`'s weights at tensor-parallel size `tp` (one process per rank)."""
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(WRITER), str(hf_dir), str(ckpt), str(step)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(tp), "PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(tp)]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs[0][-3000:]
    return ckpt


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> Path:
    """The weights the checkpoints hold: the tiny teacher's architecture and tokenizer, another seed."""
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("trained"), seed=7)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, trained_dir) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("run")
    return {tp: _write_checkpoint(trained_dir, root / f"train_step_{100 * tp}" / "dist_ckpt", 100 * tp, tp)
            for tp in (1, 2)}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist-ckpt-cache")


def _config(tmp_path: Path, model_dir: Path, ckpt: Path | str, cache_dir: Path) -> Path:
    entry = {**torch_teacher(model_dir), "dist_ckpt_path": str(ckpt)}
    return write_config(tmp_path, cpu_config({"tiny": entry}, devices=1,
                                             server={"checkpoint_cache_dir": str(cache_dir)}))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir, checkpoints, cache_dir):
    """The TP 2 checkpoint served by the torch engine from a config, as `proctor serve --config` does."""
    from proctor.server.config import load_server_config
    from proctor.server.front.runtime import ServerThread

    config = _config(tmp_path_factory.mktemp("cfg"), tiny_model_dir, checkpoints[2], cache_dir)
    started = time.perf_counter()
    router, options = load_server_config(config)
    convert_s = time.perf_counter() - started
    server = ServerThread(router, options)
    server.start()
    yield server, convert_s
    server.stop()


def test_the_resharded_checkpoint_scores_as_its_own_weights(served, trained_dir, tiny_model_dir):
    from proctor.client import SyncTeacherClient

    server, convert_s = served
    with SyncTeacherClient(server.grpc_target) as client:
        scores = client.score(IDS, topk=8)
        info = client.teachers()["tiny"]
        unembedding = client.unembedding("tiny")
    assert_matches_reference(scores.logprobs, trained_dir, IDS, atol=1e-4)
    other = reference_rows(tiny_model_dir, IDS).logprobs  # model_path's own weights: never served
    assert (scores.logprobs.double() - other).abs().max() > 1e-2
    assert torch.equal(unembedding.float(), load_file(str(trained_dir / "model.safetensors"))["lm_head.weight"])
    from proctor.server.engines.fingerprint import model_fingerprint

    assert info.fingerprint != model_fingerprint(tiny_model_dir)
    print(f"conversion at start: {convert_s:.1f} s")


def test_tp1_and_tp2_saves_convert_to_the_same_weights_and_the_cache_is_reused(served, checkpoints, cache_dir,
                                                                                   tiny_model_dir, trained_dir):
    from proctor.server.engines.megatron.convert import materialize

    folders = {tp: materialize(ckpt, tiny_model_dir, cache_dir) for tp, ckpt in checkpoints.items()}
    weights = {tp: load_file(str(folder / "model.safetensors")) for tp, folder in folders.items()}
    original = load_file(str(trained_dir / "model.safetensors"))
    for tp in (1, 2):
        assert weights[tp].keys() == original.keys()
        assert all(torch.equal(weights[tp][k], original[k]) for k in original), tp
    started = time.perf_counter()
    assert materialize(checkpoints[2], tiny_model_dir, cache_dir) == folders[2]
    assert time.perf_counter() - started < 5  # no child process, no megatron-core import: the cache
    sizes = {p.name: p.stat().st_size for p in folders[2].iterdir()}
    ckpt_bytes = sum(p.stat().st_size for p in checkpoints[2].iterdir())
    print(f"checkpoint {ckpt_bytes} B; converted folder {sum(sizes.values())} B ({sizes})")
    print((folders[2] / "conversion.json").read_text())


def test_check_config_reports_the_step_and_what_it_will_load(tmp_path, tiny_model_dir, checkpoints, cache_dir):
    from proctor.server.config.check import check_config_command

    out = io.StringIO()
    assert check_config_command(_config(tmp_path, tiny_model_dir, checkpoints[2], cache_dir), out=out) == 0
    assert f"weights from Megatron checkpoint {checkpoints[2]} (step 200, 10 model tensors" in out.getvalue()


def _refusal(tmp_path: Path, model_dir: Path, ckpt: Path | str, cache_dir: Path) -> str:
    from proctor.server.config import ConfigError, load_server_config

    with pytest.raises(ConfigError) as err:
        load_server_config(_config(tmp_path, model_dir, ckpt, cache_dir))
    (problem,) = err.value.problems
    assert "\n" not in problem and str(ckpt) in problem
    return problem


def test_a_bad_path_a_wrong_architecture_and_a_truncated_checkpoint_are_refused_in_one_line(
        tmp_path, tiny_model_dir, other_model_dir, checkpoints, cache_dir):
    missing = _refusal(tmp_path, tiny_model_dir, tmp_path / "train_step_9" / "dist_ckpt", cache_dir)
    assert "dist_ckpt_path" in missing and "is not a directory" in missing
    not_ckpt = _refusal(tmp_path, tiny_model_dir, tiny_model_dir, cache_dir)  # a HF folder, not a dist_ckpt
    assert "no metadata.json" in not_ckpt
    wrong = _refusal(tmp_path, other_model_dir, checkpoints[1], cache_dir)  # model_path has 1 layer, the run 2
    assert "does not match model_path's architecture" in wrong
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for file in checkpoints[1].iterdir():
        data = file.read_bytes()
        (truncated / file.name).write_bytes(data[: len(data) // 2] if file.suffix == ".distcp" else data)
    cut = _refusal(tmp_path, tiny_model_dir, truncated, cache_dir)
    assert "is not a usable distributed checkpoint" in cut
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]  # no half-written folder left
