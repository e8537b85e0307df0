"""A Megatron distributed checkpoint as the folder an engine loads: converted once, cached.

A teacher entry's `dist_ckpt_path` (one step's `dist_ckpt` directory) is served by turning it,
at start, into a Hugging Face folder: `model_path`'s config.json and tokenizer files beside the
checkpoint's weights as safetensors. The folder is cached under a key from the checkpoint's own
files (and `model_path`'s config), so the next start with the same checkpoint reuses it; every
engine, `GetUnembedding` and the teacher's fingerprint then read the checkpoint's weights, and
`model_path`'s own weights (if it has any) are never read.

The conversion runs in a child process (`python -m proctor.server.engines.megatron.convert`):
megatron-core's loader needs a torch.distributed process group, which the front process must
not hold. A checkpoint that is not a usable distributed checkpoint, or that does not hold exactly
the weights of `model_path`'s architecture, fails the start in one line naming the path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proctor.server.engines.base import EngineConfigError
from proctor.server.engines.fingerprint import model_fingerprint

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "proctor" / "dist-ckpt"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_DONE = "conversion.json"  # written last: a folder without it is an interrupted conversion
_SMALL = 64 << 20
_SHARD_BYTES = 4 << 30
_STEP_NAMES = re.compile(r"(?:train_step|iter|step|global_step)_?0*(\d+)$")


def check_dist_ckpt_path(path: str | Path) -> Path:
    """The directory, if it looks like one step's Megatron distributed checkpoint; else one line."""
    root = Path(path)
    if not root.is_dir():
        raise EngineConfigError(f"dist_ckpt_path: {path} is not a directory here")
    if not (root / "metadata.json").is_file():
        raise EngineConfigError(
            f"dist_ckpt_path: {path} is not a Megatron distributed checkpoint (no metadata.json): "
            "name one step's dist_ckpt directory")
    return root


def checkpoint_key(path: str | Path, model_path: str | Path) -> str:
    """sha256 (16 hex) over the checkpoint's files (small ones whole; large ones by size and
    sampled blocks) and `model_path`'s config.json: the cache key, and the checkpoint's identity."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).iterdir() if p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as handle:
            if size <= _SMALL:
                digest.update(handle.read())
            else:
                for index in range(16):
                    handle.seek((size - (1 << 20)) * index // 15)
                    digest.update(handle.read(1 << 20))
    config = Path(model_path) / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    return digest.hexdigest()[:16]


def checkpoint_step(path: str | Path, iteration: int | None = None) -> int | None:
    """The training step: the checkpoint's own `iteration`, else its directory's name
    (`train_step_N/dist_ckpt`, `iter_000N`)."""
    if iteration is not None:
        return iteration
    for part in (Path(path).name, Path(path).parent.name):
        match = _STEP_NAMES.search(part)
        if match:
            return int(match.group(1))
    return None


@dataclass(frozen=True)
class CheckpointPlan:
    """What `check-config` reports and `serve` does for a `dist_ckpt_path`."""

    path: str
    step: int | None
    tensors: int
    parallel: str
    folder: Path

    @property
    def cached(self) -> bool:
        return (self.folder / _DONE).is_file()

    def describe(self) -> str:
        step = f"step {self.step}" if self.step is not None else "step not recorded"
        action = f"cached at {self.folder}" if self.cached else f"converted at start into {self.folder}"
        return (f"weights from Megatron checkpoint {self.path} ({step}, {self.tensors} model tensors, "
                f"{self.parallel}), {action}")


def plan_checkpoint(path: str | Path, model_path: str | Path, cache_dir: str | Path | None = None) -> CheckpointPlan:
    """The checkpoint's step and size from its metadata (no tensor read), and where it is cached."""
    from proctor.server.engines.megatron import adapter

    root = check_dist_ckpt_path(path)
    try:
        layout = adapter.read_layout(root)
    except EngineConfigError:
        raise
    except Exception as exc:
        raise EngineConfigError(f"dist_ckpt_path: {path} is not a usable distributed checkpoint: {_line(exc)}") from None
    folder = Path(cache_dir or DEFAULT_CACHE_DIR) / checkpoint_key(root, model_path)
    return CheckpointPlan(str(path), checkpoint_step(root, layout.iteration), len(layout.shapes), layout.parallel, folder)


def materialize(path: str | Path, model_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The cached folder for the checkpoint, converting it first (in a child process) when absent:
    its names and shapes are checked against `model_path`'s architecture here first (metadata
    only), so a checkpoint of another architecture costs no child process."""
    from proctor.server.engines.megatron import adapter

    plan = plan_checkpoint(path, model_path, cache_dir)
    if plan.cached:
        log.info("dist_ckpt_path %s: reusing %s", path, plan.folder)
        return plan.folder
    try:
        check_architecture(adapter.read_layout(Path(path)), Path(model_path))
    except EngineConfigError as exc:
        raise EngineConfigError(f"dist_ckpt_path: {path} {exc}") from None
    plan.folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{plan.folder.name}-", dir=plan.folder.parent))
    work.chmod(0o755)
    try:
        child = subprocess.run(
            [sys.executable, "-m", "proctor.server.engines.megatron.convert", str(path), str(model_path), str(work)],
            capture_output=True, text=True, check=False)
        if child.returncode != 0:
            lines = [ln for ln in child.stderr.splitlines() if ln.startswith("proctor-convert: ")]
            last = child.stderr.strip().splitlines()[-1:] or ["no output"]
            why = (lines[-1].removeprefix("proctor-convert: ") if lines
                   else f"could not be converted (the converter exited {child.returncode}: {_line(last[0])})")
            raise EngineConfigError(f"dist_ckpt_path: {path} {why}")
        shutil.rmtree(plan.folder, ignore_errors=True)  # an interrupted earlier conversion
        os.replace(work, plan.folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("dist_ckpt_path %s: converted into %s (%s)", path, plan.folder, (plan.folder / _DONE).read_text().strip())
    return plan.folder


def _line(exc: object) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


# ------------------------------------------------------------------------------------------
# The child process: read, map, check, write
# ------------------------------------------------------------------------------------------


def _expected_weights(model_path: Path) -> dict[str, tuple[int, ...]]:
    """The weights `model_path`'s architecture has (built on the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from proctor.server.engines.torch.loading import build

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = build(AutoModelForCausalLM.from_config, config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_architecture(layout: Any, model_path: Path) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """The bridge and the architecture's weights, once the checkpoint's tensors (by name and shape,
    mapped on the meta device: no data) are exactly those weights; else EngineConfigError."""
    from proctor.server.engines.megatron import adapter

    bridge = adapter.bridge_for(str(model_path))
    expected = _expected_weights(model_path)
    got: dict[str, tuple[int, ...]] = {}
    for key, shape in layout.shapes.items():
        try:
            got.update((n, tuple(t.shape)) for n, t in
                       adapter.hf_tensors(bridge, key, torch.empty(shape, dtype=layout.dtypes[key], device="meta")))
        except (NotImplementedError, KeyError, ValueError, IndexError, RuntimeError):
            raise EngineConfigError(
                f"does not match model_path's architecture ({bridge.hf_config.model_type}): it holds {key} "
                f"{list(shape)}, which that architecture has no weight for") from None
    _check_weights(got, expected, bridge.hf_config.model_type)
    return bridge, expected


def _check_weights(got: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], model_type: str) -> None:
    """EngineConfigError unless `got` is exactly the architecture's weights, by name and shape."""
    if got == expected:
        return
    wrong = sorted(n for n in expected.keys() & got.keys() if got[n] != expected[n])
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    what = "; ".join(filter(None, [
        f"{wrong[0]} is {list(got[wrong[0]])}, the architecture's is {list(expected[wrong[0]])}" if wrong else "",
        f"{len(missing)} weight(s) missing (e.g. {missing[0]})" if missing else "",
        f"{len(extra)} weight(s) the architecture lacks (e.g. {extra[0]})" if extra else ""]))
    raise EngineConfigError(f"does not match model_path's architecture ({model_type}): {what}")


def convert(path: Path, model_path: Path, out: Path) -> dict:
    """Write `out`: the checkpoint's weights as safetensors, with model_path's config and tokenizer."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from proctor.server.engines.megatron import adapter

    started = time.perf_counter()
    layout = adapter.read_layout(path)
    bridge, expected = check_architecture(layout, model_path)
    dist.init_process_group("gloo", init_method=f"file://{out}/.store", rank=0, world_size=1)
    weights: dict[str, torch.Tensor] = {}
    try:
        for key, shape in layout.shapes.items():
            try:
                tensor = adapter.load_tensor(path, key, shape, layout.dtypes[key])
            except Exception as exc:
                raise EngineConfigError(f"is not a usable distributed checkpoint: reading {key}: {_line(exc)}") from None
            try:
                weights.update((n, t.contiguous()) for n, t in adapter.hf_tensors(bridge, key, tensor))
            except RuntimeError as exc:  # a fused tensor that does not split as the architecture says
                raise EngineConfigError(
                    f"does not match model_path's architecture: {key} {list(shape)}: {_line(exc)}") from None
    finally:
        dist.destroy_process_group()
        (out / ".store").unlink(missing_ok=True)
    _check_weights({n: tuple(t.shape) for n, t in weights.items()}, expected, bridge.hf_config.model_type)
    _write_shards(weights, out, save_file)
    for file in Path(model_path).iterdir():
        if file.is_file() and file.suffix not in _WEIGHT_SUFFIXES and not file.name.endswith(".index.json"):
            shutil.copy2(file, out / file.name)
    facts = {"seconds": round(time.perf_counter() - started, 3),
             "weight_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
             "step": checkpoint_step(path, layout.iteration), "source": str(path)}
    facts["fingerprint"] = model_fingerprint(out)
    (out / _DONE).write_text(json.dumps(facts) + "\n")
    return facts


def _write_shards(weights: dict[str, torch.Tensor], out: Path, save_file) -> None:
    """One model.safetensors, or shards of at most _SHARD_BYTES with the usual index."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def main(argv: list[str]) -> int:
    """The child: convert, or print one `proctor-convert: <why>` line and exit 2."""
    path, model_path, out = (Path(a) for a in argv)
    try:
        print(json.dumps(convert(path, model_path, out)))
    except EngineConfigError as exc:
        print(f"proctor-convert: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
