"""Where a teacher's weights come from, as the plan sees it: its `model_path` (a folder, or a
Hugging Face id resolved in the hub cache) and its `dist_ckpt_path` (whether it is here, and what
`serve` will load from it: `check-config`'s line). The conversion itself is
`engines/megatron/convert.py`, run by `builder.convert_checkpoints` before any replica starts."""

from __future__ import annotations

from pathlib import Path

from proctor.server.engines.base import EngineConfigError


def weights_source(teacher: str, model_path: str, *, download: bool, missing: list[str], notes: list[str]) -> str | None:
    """The folder a `model_path` names: a Hugging Face id resolved to its hub-cache snapshot (`serve`
    fetches it there first; `check-config` only looks), noted; None where it is already a folder,
    or is missing (then the problem is added to `missing`)."""
    from proctor.server.engines.checks import check_model_path

    try:
        path = check_model_path(model_path, download=download)
    except EngineConfigError as exc:
        missing.append(f"distillation.teacher_models.{teacher}.{exc}")
        return None
    if str(path) == model_path or Path(model_path).expanduser().exists():
        return None
    notes.append(f"teacher {teacher}: model_path {model_path} is the hub cache's {path}")
    return str(path)


def missing_checkpoint(teacher: str, dist_ckpt_path: str | None) -> list[str]:
    """The one-line problem of a `dist_ckpt_path` that is not a distributed checkpoint here."""
    if not dist_ckpt_path:
        return []
    from proctor.server.engines.megatron.convert import check_dist_ckpt_path

    try:
        check_dist_ckpt_path(dist_ckpt_path)
    except EngineConfigError as exc:
        return [f"distillation.teacher_models.{teacher}.{exc}"]
    return []


def checkpoint_line(dist_ckpt_path: str, model_path: str, cache_dir: str | Path | None) -> str:
    """What `serve` will load for a `dist_ckpt_path`: its step, its size, the cache; or why not."""
    from proctor.server.engines.megatron.convert import plan_checkpoint

    try:
        return plan_checkpoint(dist_ckpt_path, model_path, cache_dir).describe()
    except EngineConfigError as exc:
        return f"`proctor serve` would refuse {exc}"
