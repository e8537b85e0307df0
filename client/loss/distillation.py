"""``distillation_loss``: the verl-compatible entry point over the loss families.

It reproduces verl 0.9.1's ``distillation_loss`` where verl defines it:

* the per-token loss of ``loss_mode`` (``forward_kl_topk`` floored at 0 per
  token, since a top-k forward KL can go negative);
* ``loss_min`` / ``loss_max`` logged over valid tokens *before* clamping;
* every mode's per-token loss clamped to ±``loss_max_clamp``;
* policy-gradient use: the detached per-token loss is a penalty subtracted from
  the advantages (verl feeds ``-loss`` as the advantage of a vanilla PG loss);
* supervised use: the masked, aggregated, differentiable loss;
* ``distillation_loss_coef`` applied only together with task rewards.

It adds verl-omni's hidden-state modes (``nitrobrew``, ``nitrobrew_reverse_kl``,
with ``kd_temperature``), proctor's ``full_jsd`` / ``topk_reverse_kl`` /
``topk_jsd``, and LoongSage-style mixing: ``pg_ratio`` scales the advantage
penalty, ``gkd_ratio`` = λ mixes ``(1 - λ)·L_RL + λ·L_GKD``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .aggregate import aggregate
from .full_vocab import full_vocab_kl
from .metrics import loss_metrics
from .sampled import sampled_kl
from .settings import LossSettings
from .topk import topk_kl, topk_masses


@dataclass
class DistillationOutput:
    """What a trainer needs from one micro-batch.

    ``per_token_loss``: ``[N]`` after verl's floors and clamps (differentiable in
    supervised use). ``loss``: the aggregated scalar, already multiplied by the
    coefficient (supervised use; None in policy-gradient use).
    ``advantage_penalty``: detached ``[N]`` to subtract from the advantages
    (policy-gradient use; None otherwise). ``metrics``: floats for logging.
    """

    settings: LossSettings
    per_token_loss: torch.Tensor
    loss: torch.Tensor | None
    advantage_penalty: torch.Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)

    def combine(self, rl_loss: torch.Tensor | float | None = None) -> torch.Tensor | float:
        """The objective to backpropagate, given the task (RL) loss if any.

        Policy-gradient use: the penalty already shaped the advantages, so the RL
        loss is returned as is. Supervised use: ``(1 - λ)·L_RL + λ·L_GKD`` with
        ``gkd_ratio`` = λ; otherwise verl's ``L_RL + coef·L_distill`` with task
        rewards and ``L_distill`` alone without.
        """
        s = self.settings
        if self.loss is None:
            if rl_loss is None:
                raise ValueError("policy-gradient use needs rl_loss: the penalty goes through the advantages")
            return rl_loss
        if s.gkd_ratio is not None:
            lam = float(s.gkd_ratio)
            return (1.0 - lam) * (0.0 if rl_loss is None else rl_loss) + lam * self.loss
        if s.use_task_rewards:
            if rl_loss is None:
                raise ValueError("use_task_rewards=true needs rl_loss to combine with")
            return rl_loss + self.loss
        return self.loss


def _per_token(s: LossSettings, inputs: dict[str, Any]) -> torch.Tensor:
    """The raw per-token loss of ``s.loss_mode``."""
    student = {k: inputs.get(k) for k in ("student_hidden", "student_weight", "student_logits")}
    if s.is_sampled:
        if inputs.get("student_logprobs") is None or inputs.get("teacher_logprobs") is None:
            raise ValueError(f"loss_mode={s.loss_mode!r} needs student_logprobs and teacher_logprobs")
        return sampled_kl(inputs["student_logprobs"], inputs["teacher_logprobs"], s.loss_mode)
    if s.is_topk:
        ids, lps = inputs.get("teacher_topk_ids"), inputs.get("teacher_topk_logprobs")
        if ids is None or lps is None:
            raise ValueError(f"loss_mode={s.loss_mode!r} needs teacher_topk_ids and teacher_topk_logprobs")
        if s.loss_mode == "forward_kl_topk":
            # As verl: no temperature, clamp on both sides, floored at 0 per token.
            out = topk_kl(
                ids, lps, **student, direction="forward",
                log_prob_min_clamp=s.log_prob_min_clamp, chunk_tokens=s.chunk_tokens,
            )
            return out.clamp_min(0.0)
        direction = "reverse" if s.loss_mode == "topk_reverse_kl" else "jsd"
        return topk_kl(
            ids, lps, **student, direction=direction, beta=s.jsd_beta,
            temperature=s.kd_temperature, chunk_tokens=s.chunk_tokens,
        )
    if inputs.get("teacher_hidden") is None or inputs.get("teacher_weight") is None:
        raise ValueError(f"loss_mode={s.loss_mode!r} needs teacher_hidden and teacher_weight")
    direction = {"nitrobrew": "forward", "nitrobrew_reverse_kl": "reverse", "full_jsd": "jsd"}[s.loss_mode]
    return full_vocab_kl(
        inputs["teacher_hidden"], inputs["teacher_weight"], **student, direction=direction,
        beta=s.jsd_beta, temperature=s.kd_temperature,
        log_prob_min_clamp=s.log_prob_min_clamp if direction == "forward" else None,
        chunk_tokens=s.chunk_tokens, chunk_vocab=s.chunk_vocab, teacher_index=inputs.get("teacher_index"),
    )


def distillation_loss(
    config: Any,
    *,
    mask: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
    student_logprobs: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: Any = None,
    teacher_index: torch.Tensor | None = None,
    student_hidden: torch.Tensor | None = None,
    student_weight: torch.Tensor | None = None,
    student_logits: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> DistillationOutput:
    """Compute the distillation term of a training step as verl would.

    ``config``: verl's ``distillation_loss`` block (or the ``distillation``
    block), as a dict or an object. ``mask``: valid response tokens ``[N]``.
    ``agg_kwargs`` go to ``aggregate`` (``dp_size``, ``batch_num_tokens``,
    ``global_batch_size``, ``loss_scale_factor``).
    """
    s = LossSettings.from_config(config)
    inputs = dict(
        student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs,
        teacher_topk_ids=teacher_topk_ids, teacher_topk_logprobs=teacher_topk_logprobs,
        teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_index=teacher_index,
        student_hidden=student_hidden, student_weight=student_weight, student_logits=student_logits,
    )
    per_token = _per_token(s, inputs)
    student_mass = teacher_mass = None
    if s.is_topk:
        student_mass, teacher_mass = topk_masses(
            teacher_topk_ids, teacher_topk_logprobs, student_hidden=student_hidden,
            student_weight=student_weight, student_logits=student_logits, chunk_tokens=s.chunk_tokens,
            temperature=1.0 if s.loss_mode == "forward_kl_topk" else s.kd_temperature,
        )
    metrics = loss_metrics(per_token, mask, student_mass=student_mass, teacher_mass=teacher_mass)
    if s.is_sampled:
        valid = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask.bool()
        metrics["abs_loss"] = per_token.detach()[valid].abs().mean().item() if bool(valid.any()) else float("nan")
    if s.loss_max_clamp is not None:
        # k1 can be negative, hence the symmetric clamp.
        per_token = per_token.clamp(min=-float(s.loss_max_clamp), max=float(s.loss_max_clamp))
    if s.use_policy_gradient:
        scale = s.coefficient * (1.0 if s.pg_ratio is None else float(s.pg_ratio))
        penalty = per_token.detach() * scale
        if mask is not None:
            penalty = torch.where(mask.bool(), penalty, torch.zeros_like(penalty))
        return DistillationOutput(s, per_token, None, penalty, metrics)
    loss = aggregate(per_token, mask, s.loss_agg_mode, seq_index=seq_index, **agg_kwargs) * s.coefficient
    metrics["loss_aggregated"] = float(loss.detach())
    return DistillationOutput(s, per_token, loss, None, metrics)
