"""The ``distillation_loss`` settings, read from verl/verl-omni configs and validated in one place.

Accepts verl's ``distillation.distillation_loss`` block (a dict, an OmegaConf
node or a dataclass-like object with attributes), or the enclosing
``distillation`` block. Validation follows verl and verl-omni, with messages
that say what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from proctor.proto.loss_modes import LOSS_MODES, LOSS_SETTINGS, VERL_IGNORED_LOSS_KEYS, LossFamilies

from .aggregate import AGG_MODES


@dataclass(frozen=True)
class LossSettings(LossFamilies):
    """Everything ``distillation_loss`` reads from the config.

    Defaults are those of verl's `distillation.yaml` (what a verl run actually gets, and what
    the server's config assumes), not of its dataclass (topk 128, clamps ±10, policy gradient on),
    so that a partial config means the same thing on both sides of the wire.
    """

    loss_mode: str = LOSS_SETTINGS["loss_mode"]
    topk: int | None = LOSS_SETTINGS["topk"]
    use_task_rewards: bool = LOSS_SETTINGS["use_task_rewards"]
    distillation_loss_coef: float = LOSS_SETTINGS["distillation_loss_coef"]
    loss_max_clamp: float | None = LOSS_SETTINGS["loss_max_clamp"]
    log_prob_min_clamp: float | None = LOSS_SETTINGS["log_prob_min_clamp"]
    use_policy_gradient: bool = LOSS_SETTINGS["use_policy_gradient"]
    policy_loss_mode: str = LOSS_SETTINGS["policy_loss_mode"]
    # verl-omni
    kd_temperature: float = LOSS_SETTINGS["kd_temperature"]
    # proctor
    jsd_beta: float = LOSS_SETTINGS["jsd_beta"]
    student_topk_form: str = LOSS_SETTINGS["student_topk_form"]
    loss_agg_mode: str = LOSS_SETTINGS["loss_agg_mode"]
    chunk_tokens: int | None = LOSS_SETTINGS["chunk_tokens"]
    chunk_vocab: int | None = LOSS_SETTINGS["chunk_vocab"]
    # LoongSage-style mixing
    pg_ratio: float | None = LOSS_SETTINGS["pg_ratio"]
    gkd_ratio: float | None = LOSS_SETTINGS["gkd_ratio"]


    @property
    def coefficient(self) -> float:
        """verl applies ``distillation_loss_coef`` only alongside task rewards."""
        return float(self.distillation_loss_coef) if self.use_task_rewards else 1.0

    def validate(self) -> None:
        """Raise with a message that says what to change."""
        if self.loss_mode not in LOSS_MODES:
            raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {self.loss_mode!r}")
        if self.policy_loss_mode != "vanilla":
            raise NotImplementedError(
                "Only vanilla policy loss is currently supported when use_policy_gradient is True, "
                f"but got {self.policy_loss_mode}."
            )
        if not self.use_policy_gradient and self.loss_mode == "k1":
            raise ValueError(
                "Directly backpropagating k1 loss is incorrect since gradient of k1 loss"
                " wrt model weights does not depend on teacher log probabilities."
                " Set use_policy_gradient=true or pick another loss_mode (e.g. k3)."
            )
        if self.use_policy_gradient and self.is_hidden_state:
            raise ValueError(
                f"loss_mode={self.loss_mode!r} is a full-vocabulary loss and must be backpropagated "
                "as a supervised loss so the whole-vocabulary signal reaches the student. "
                "Set distillation.distillation_loss.use_policy_gradient=false."
            )
        if (self.is_topk or self.is_student_topk) and (
            not isinstance(self.topk, int) or isinstance(self.topk, bool) or self.topk <= 0
        ):
            raise ValueError(f"topk must be a positive int for loss_mode={self.loss_mode!r}, got {self.topk!r}")
        if self.loss_max_clamp is not None and not float(self.loss_max_clamp) > 0:
            raise ValueError(f"loss_max_clamp must be positive or null, got {self.loss_max_clamp}")
        if not float(self.kd_temperature) > 0:
            raise ValueError(f"kd_temperature must be positive, got {self.kd_temperature}")
        if self.student_topk_form not in ("exact", "renormalised"):
            raise ValueError(f"student_topk_form must be 'exact' or 'renormalised', got {self.student_topk_form!r}")
        if not 0.0 <= float(self.jsd_beta) <= 1.0:
            raise ValueError(f"jsd_beta must lie in [0, 1], got {self.jsd_beta}")
        if self.gkd_ratio is not None and not 0.0 <= float(self.gkd_ratio) <= 1.0:
            raise ValueError(f"gkd_ratio must lie in [0, 1], got {self.gkd_ratio}")
        if self.pg_ratio is not None and not float(self.pg_ratio) >= 0.0:
            raise ValueError(f"pg_ratio must be non-negative, got {self.pg_ratio}")
        if self.gkd_ratio is not None and self.use_policy_gradient:
            raise ValueError(
                "gkd_ratio mixes a supervised GKD loss into the RL loss; set use_policy_gradient=false "
                "to use it (or use pg_ratio to scale the policy-gradient penalty)."
            )
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {self.loss_agg_mode!r}")

    @classmethod
    def from_config(cls, config: Any) -> LossSettings:
        """Read a dict / OmegaConf node / attribute object; unknown dict keys are an error."""
        if isinstance(config, LossSettings):
            config.validate()
            return config
        block = config_value(config, "distillation_loss", None)
        if block is not None and config_value(config, "loss_mode", None) is None:
            config = block
        names = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        if isinstance(config, Mapping) or hasattr(config, "keys"):
            for raw_key in config:
                key = str(raw_key)
                if key in names:
                    values[key] = config[raw_key]
                elif key not in VERL_IGNORED_LOSS_KEYS:
                    raise ValueError(
                        f"unknown distillation_loss setting {key!r}; known settings: {sorted(names)}"
                    )
        else:
            for name in names:
                if hasattr(config, name):
                    values[name] = getattr(config, name)
        settings = cls(**values)
        settings.validate()
        return settings


def config_value(node: Any, key: str, default: Any = None) -> Any:
    """`node[key]` for a trainer's config in any of its shapes (dict, OmegaConf DictConfig,
    dataclass or plain object, None), `default` where it has no such key."""
    if node is None:
        return default
    if isinstance(node, Mapping) or hasattr(node, "keys"):
        try:
            return node.get(key, default)
        except (TypeError, AttributeError):
            return default
    return getattr(node, key, default)
