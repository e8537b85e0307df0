"""`proctor serve` refuses a flag it cannot serve in one line on stderr (exit 1), never a traceback.

Each case once reached a replica (or the event loop) and died there with tens to hundreds of
lines of traceback. The `--inference` keys are held to the config file's unknown-key rule, with
the same words as `check-config` gives for the same typo in a file.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from proctor.server.config import check_config_command
from proctor.server.config.reading import inference_flag_problems


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "serve", "--grpc-port", "0",
                           "--http-port", "0", "--no-verbose", *args], capture_output=True, text=True, timeout=120)


def _one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("proctor: cannot serve: ")
    return lines[0]


@pytest.mark.parametrize(("args", "says"), [
    (["--engine", "vlm"], "inference.name is 'vlm': proctor has no such engine; choose one of torch, vllm, vllm_omni"),
    (["--replicas", "0"], "--replicas is 0: a teacher needs at least 1 replica"),
    (["--device", "tpu"], "device 'tpu' is not one proctor places teachers on"),
])
def test_a_flag_it_cannot_serve_is_one_line(args, says):
    assert says in _one_line(_serve(*args))


def test_cuda_on_a_machine_without_cuda_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "device 'cuda' asked for, but CUDA is not available" in _one_line(_serve("--device", "cuda"))


def test_an_inference_key_typo_is_refused_as_a_config_file_refuses_it(tmp_path, tiny_model_dir, capsys):
    line = _one_line(_serve("--inference", "max_modle_len=10"))
    assert line.endswith("inference.max_modle_len: unknown key (did you mean max_model_len?)")
    config = tmp_path / "typo.yaml"
    config.write_text(f"distillation:\n  teacher_models:\n    t:\n      model_path: {tiny_model_dir}\n"
                      "      inference:\n        max_modle_len: 10\n")
    assert check_config_command(config) == 1
    assert "inference.max_modle_len: unknown key (did you mean max_model_len?)" in capsys.readouterr().out


def test_the_keys_only_the_command_line_takes_pass_the_key_rule():
    """`replica_worker` and the like, which a config file puts elsewhere (a bad value is the engine's to refuse)."""
    assert inference_flag_problems({"replica_worker": False, "health_timeout_s": 5, "max_logprobs": 20}) == []
    assert inference_flag_problems({"replica_workers": False}) == [
        "inference.replica_workers: unknown key (did you mean replica_worker?)"]
