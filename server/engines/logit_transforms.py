"""What a model does to its lm_head's output before the softmax, read from its config.

Some families do not score with `lm_head(h)` alone: Gemma-2/3 soft-cap the final logits
(`final_logit_softcapping`: `tanh(x / c) * c`), Cohere/Command-R multiply them by `logit_scale`,
Granite divides them by `logits_scaling`. An lm_head bias is part of the head module itself. The
torch engine applies these (`apply`) after the head and then checks at start that its path
reproduces the model's own forward (`torch.engine`), refusing a model it cannot reproduce; vLLM's
scoring pooler needs none of this (it calls the model's own `compute_logits`); vLLM-Omni's
hidden-state score_ids refuse a model with any transform (`describe` names it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LogitTransforms:
    softcap: float | None = None  # tanh(x / c) * c
    scale: float = 1.0  # x * scale (Cohere's logit_scale; 1 / Granite's logits_scaling)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is not None:  # in vLLM's order: soft-cap, then scale
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    @property
    def identity(self) -> bool:
        return self.softcap is None and self.scale == 1.0

    def describe(self) -> str:
        parts = []
        if self.softcap is not None:
            parts.append(f"final-logit soft-capping at {self.softcap}")
        if self.scale != 1.0:
            parts.append(f"a logit scale of {self.scale}")
        return " and ".join(parts) or "none"


def _get(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def logit_transforms(config: Any) -> LogitTransforms:
    """The transforms a (text) config declares; a nested config's `text_config` is read first."""
    text = _get(config, "text_config") or config
    softcap = _get(text, "final_logit_softcapping")
    scale = float(_get(text, "logit_scale") or 1.0)
    granite = _get(text, "logits_scaling")
    if granite:
        scale = scale / float(granite)
    return LogitTransforms(softcap=float(softcap) if softcap else None, scale=scale)
