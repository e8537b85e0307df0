"""The one place proctor reaches into megatron-core and mbridge: every name of theirs it uses, and
the releases it supports.

A Megatron distributed checkpoint (`dist_ckpt`) is read by megatron-core's own
`dist_checkpointing`: its metadata (`metadata.json`, the torch_dist `.metadata`, `common.pt`) and
each model tensor loaded whole, whatever the tensor/pipeline/expert parallel sizes of the run that
saved it (megatron-core assembles the shards: the re-shard happens in its loader). Megatron's
names and fused layouts (`decoder.layers.*` stacked on a leading layer axis, interleaved QKV,
gate and up projections in one matrix) become Hugging Face names and tensors by mbridge's model
bridge for the `model_type` of `model_path`'s config.json (the bridge verl and slime use); proctor
writes no name mapping of its own. Neither library builds a model here: the bridge's mapping is
used on whole tensors, so no Transformer Engine, CUDA or parallel state is needed.

Both libraries' names used here are internals that change between releases (mbridge's mapping
methods are private), so the installed releases are checked against the supported-version table
(pyproject.toml's `megatron` extra) before anything is read.

Supported: megatron-core 0.16.1 with mbridge 0.15.1 (what the tests run, on CPU).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proctor.proto import versions
from proctor.server.engines.base import EngineConfigError

# Tensors of a training checkpoint that are not the model's (optimizer moments, RNG state).
NOT_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine")
# megatron-core stacks a block's layers on a leading axis under these sharded keys.
_STACKED = re.compile(r"^(?P<block>(?:.*\.)?decoder\.layers)\.(?P<rest>.+)$")


class CheckpointReadError(RuntimeError):
    """megatron-core (torch's reader beneath it) could not read a tensor's shards."""


def check_versions() -> dict[str, str | None]:
    """Refuse releases the table does not claim (one line naming installed and supported)."""
    try:
        return versions.check_versions(("megatron-core", "mbridge"), needed_by="dist_ckpt_path")
    except versions.UnsupportedVersion as exc:
        raise EngineConfigError(str(exc)) from None


@dataclass(frozen=True)
class Layout:
    """What a distributed checkpoint's metadata says: its model tensors' global shapes and dtypes,
    and its common state (Megatron-LM puts `iteration` and `args` there)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    common: Mapping[str, Any]

    @property
    def iteration(self) -> int | None:
        value = self.common.get("iteration")
        return int(value) if isinstance(value, int) else None

    @property
    def parallel(self) -> str:
        """The parallel sizes of the run that saved it, where its `args` say (Megatron-LM's)."""
        args = self.common.get("args")
        sizes = [(k, getattr(args, f"{k}_model_parallel_size", None)) for k in ("tensor", "pipeline")]
        known = [f"{k[0].upper()}P{v}" for k, v in sizes if isinstance(v, int)]
        return " ".join(known) or "parallel sizes not recorded"


def check_shard_files(ckpt: Path) -> None:
    """Every shard file is as long as torch_dist's metadata says its tensors reach (a copy cut
    short is found here, before any tensor is read); CheckpointReadError naming the file if not."""
    from torch.distributed.checkpoint import FileSystemReader

    ends: dict[str, int] = {}
    for info in (FileSystemReader(str(ckpt)).read_metadata().storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (ckpt / name).stat().st_size if (ckpt / name).is_file() else None
        if size is None or size < end:
            held = "is missing" if size is None else f"has {size} bytes"
            raise CheckpointReadError(f"shard file {name} {held}, its metadata needs {end} (a shard file ends early)")


def read_layout(ckpt: Path) -> Layout:
    """The checkpoint's metadata, read by megatron-core (no tensor data is read), its shard files
    checked against it."""
    check_versions()
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(ckpt))
    common = dist_checkpointing.load_common_state_dict(str(ckpt)) or {}
    check_shard_files(ckpt)
    model = {k: v for k, v in metadata.items() if not k.startswith(NOT_MODEL_PREFIXES) and "_extra_state" not in k}
    return Layout(
        shapes={k: tuple(v.global_shape) for k, v in model.items()},
        dtypes={k: v.dtype for k, v in model.items()},
        common=common,
    )


def bridge_for(model_path: str) -> Any:
    """mbridge's bridge for the architecture of `model_path`'s config.json, on one process."""
    check_versions()
    from mbridge import AutoBridge
    from mbridge.core.parallel_states import ParallelStates
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    try:
        return AutoBridge.from_config(config, parallel_states=ParallelStates())
    except ValueError as exc:  # an architecture mbridge has no bridge for
        raise EngineConfigError(f"mbridge has no bridge for model_type {config.model_type!r} ({exc})") from None


def _unstacked(key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked `decoder.layers.X` tensor as one `decoder.layers.<i>.X` per layer (the local
    names mbridge maps); other tensors as they are."""
    match = _STACKED.match(key)
    if match is None:
        yield key, tensor
        return
    for index, layer in enumerate(tensor.unbind(0)):
        yield f"{match['block']}.{index}.{match['rest']}", layer


def load_tensor(ckpt: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One model tensor whole, assembled from its shards by megatron-core's loader (the re-shard).

    Needs a torch.distributed process group (world size 1 is enough): megatron-core's torch_dist
    loader asks for the rank."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.checkpoint.api import CheckpointException

    sharded = {key: ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype), replica_id=0)}
    try:
        return dist_checkpointing.load(sharded, str(ckpt), validate_access_integrity=False)[key]
    except CheckpointException as exc:  # a BaseException: torch's reader failed on a shard file
        errors = [e[0] if isinstance(e, tuple) else e for e in getattr(exc, "failures", {}).values()]
        causes = [f"{type(e).__name__} {e}".strip() + (" (a shard file ends early)" if isinstance(e, EOFError) else "")
                  for e in errors]
        raise CheckpointReadError("; ".join(causes) or str(exc)) from None


def hf_tensors(bridge: Any, key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A Megatron tensor (global, whole) as the Hugging Face tensors it holds, by the bridge's mapping."""
    for name, part in _unstacked(key, tensor):
        names, parts = bridge._weight_to_hf_format(name, part)
        yield from zip(names, parts, strict=True)
