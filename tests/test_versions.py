"""The supported-version table (pyproject.toml, read back by `proctor.proto.versions`) and the
start-up check of `proctor serve`: a release outside it is one clear line on stderr and exit 1.

The releases are faked the way pip would leave them: a `<name>-<version>.dist-info` directory
first on PYTHONPATH, so `importlib.metadata` reports that release; the server itself is real.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from proctor.proto import versions
from proctor.server.engines.base import EngineConfigError

from support.configs import cpu_config, torch_teacher, write_config

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    import tomllib  # (inside: ruff's isort still classifies for 3.10, see pyproject.toml)

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_table_is_pyproject_toml_as_installed():
    """The metadata the checks read is pyproject.toml's (a stale install would check an old table)."""
    project = _pyproject()
    assert SpecifierSet(project["requires-python"]) == versions.claims("python")[0].specifier
    written = {(Requirement(r).name, str(Requirement(r).specifier), None) for r in project["dependencies"]}
    for extra, requirements in project["optional-dependencies"].items():
        written |= {(Requirement(r).name, str(Requirement(r).specifier), extra) for r in requirements}
    for component in versions.COMPONENTS:
        if component == versions.PYTHON:
            continue
        rows = versions.claims(component)
        assert rows, f"{component} has no row in pyproject.toml"
        for row in rows:
            assert (row.distribution, str(row.specifier), row.extra) in written


def test_what_ci_installs_is_what_the_table_claims():
    installed = [c for c in versions.COMPONENTS if versions.installed(c) is not None]
    assert {"python", "torch", "transformers", "trl"} <= set(installed)
    versions.check_versions(installed)  # raises, naming every mismatch, if CI ran something unclaimed
    assert versions.installed("vllm-omni") is None  # it runs in .venv-omni (scripts/install_omni.sh), not here


def test_the_lowest_claimed_python_is_the_one_running_the_suite():
    """Claim only what runs: the suite's Python is the lowest Requires-Python allows (on CI), and
    the release before it is refused (3.10: server/front/service.py uses asyncio.timeout)."""
    (row,) = versions.claims("python")
    (lower,) = [s for s in row.specifier if s.operator == ">="]
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if os.environ.get("CI"):
        assert lower.version == running, f"CI runs Python {running}; the lowest claimed is {lower.version}"
    assert versions.problem("python") is None
    below = f"3.{int(lower.version.split('.')[1]) - 1}.12"
    assert versions.problem("python", below) == (
        f"Python {below} is running, but proctor supports Python >={lower.version}: run proctor on a supported Python"
    )


def test_a_mismatch_names_the_installed_and_the_supported_release():
    supported = versions.describe(versions.claims("transformers"))
    assert versions.problem("transformers", "4.40.0", needed_by="inference.name=torch") == (
        f"transformers 4.40.0 is installed, but proctor supports transformers {supported} "
        f"(for inference.name=torch): pip install 'transformers{supported}'"
    )
    assert versions.problem("torch", "2.13.0+cu128") is None  # a local build of a claimed release
    assert "0.30.0 or 0.18.0" in versions.problem("vllm-omni")  # not installed: says what is supported
    assert versions.pinned("vllm") == ("0.32.0",)


def test_the_vllm_adapter_checks_against_the_same_table():
    from proctor.server.engines.vllm.adapter import SUPPORTED_VLLM, check_vllm_version

    assert versions.pinned("vllm") == SUPPORTED_VLLM
    with pytest.raises(EngineConfigError) as refused:
        check_vllm_version("0.10.1")
    assert str(refused.value) == versions.problem("vllm", "0.10.1", needed_by="inference.name=vllm")


def _fake_release(root: Path, name: str, version: str) -> None:
    """What pip leaves for an installed release, as far as `importlib.metadata` reads it."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _serve(args: list[str], fakes: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(fakes), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "serve", "--grpc-port", "0",
                           "--http-port", "0", *args], env=env, capture_output=True, text=True, timeout=300)


def test_serving_on_an_unsupported_transformers_is_one_line_and_exit_1(tmp_path, tiny_model_dir):
    _fake_release(tmp_path / "fakes", "transformers", "4.40.0")
    done = _serve(["--model", str(tiny_model_dir)], tmp_path / "fakes")
    supported = versions.describe(versions.claims("transformers"))
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"proctor: cannot serve: transformers 4.40.0 is installed, but proctor supports transformers {supported} "
        f"(for inference.name=torch): pip install 'transformers{supported}'"
    ]


def test_serving_on_an_unsupported_vllm_is_one_line_and_exit_1(tmp_path, tiny_model_dir):
    _fake_release(tmp_path / "fakes", "vllm", "0.10.1")
    done = _serve(["--model", str(tiny_model_dir), "--engine", "vllm"], tmp_path / "fakes")
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("proctor: cannot serve: vLLM 0.10.1 is installed, but proctor supports vLLM 0.32.0 "
                           "(for inference.name=vllm): pip install 'proctor[vllm]'")


def test_a_config_s_teachers_are_checked_together_in_one_line(tmp_path, tiny_model_dir):
    """`--config`: every engine the teachers name, each component once, all mismatches on one line."""
    _fake_release(tmp_path / "fakes", "vllm", "0.10.1")
    _fake_release(tmp_path / "fakes", "transformers", "4.40.0")
    on_vllm = torch_teacher(tiny_model_dir, key="b")
    on_vllm["inference"]["name"] = "vllm"
    config = write_config(tmp_path, cpu_config({"a": torch_teacher(tiny_model_dir, key="a"), "b": on_vllm}, devices=2))
    done = _serve(["--config", str(config)], tmp_path / "fakes")
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    assert "transformers 4.40.0 is installed" in line and "(for inference.name=torch and inference.name=vllm)" in line
    assert "; vLLM 0.10.1 is installed, but proctor supports vLLM 0.32.0" in line
    assert line.count("transformers 4.40.0") == 1


def test_patch_verl_refuses_a_verl_it_was_not_tested_against(tmp_path):
    """The trainer side checks its verl against the same table before it replaces verl internals."""
    _fake_release(tmp_path / "fakes", "verl", "0.4.1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "fakes"),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", "from proctor.trainer_adapter.verl import patch_verl; patch_verl()"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert ("verl 0.4.1 is installed, but proctor supports verl 0.9.1 (for proctor.trainer_adapter.patch_verl)"
            in done.stderr), done.stderr
