"""Config files for suites that build servers as `proctor serve --config` does: verl's
`distillation:` block plus proctor's `server:` block, written from dicts."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_config(tmp_path: Path, document: dict, name: str = "proctor.yaml") -> Path:
    """`document` as YAML in `tmp_path`; the path, for the config loaders."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def torch_teacher(model_dir: Path | str, *, key: str | None = None, num_replicas: int | None = 1) -> dict:
    """A verl teacher_models entry for the torch engine on one CPU 'device' per replica."""
    entry: dict = {
        "model_path": str(model_dir),
        "inference": {"name": "torch", "tensor_model_parallel_size": 1, "dtype": "float32",
                      "prompt_length": 64, "response_length": 64, "max_model_len": 256},
    }
    if key is not None:
        entry["key"] = key
    if num_replicas is not None:
        entry["num_replicas"] = num_replicas
    return entry


def cpu_config(teachers: dict, *, devices: int, server: dict | None = None) -> dict:
    """A whole config on `devices` CPU 'devices', any free ports and quick health sweeps and restarts."""
    return {
        "distillation": {
            "enabled": True,
            "nnodes": 1,
            "n_gpus_per_node": devices,
            "teacher_key": "data_source",
            "teacher_models": teachers,
            "distillation_loss": {"loss_mode": "forward_kl_topk", "topk": 8},
        },
        "server": {"device": "cpu", "grpc_port": 0, "http_port": 0, "health_check_interval_s": 0.5,
                   "restart_initial_backoff_s": 0.1, **(server or {})},
    }
