"""``distillation_loss``: the verl-compatible entry point over the loss families.

It reproduces verl 0.9.1's ``distillation_loss`` where verl defines it:

* the per-token loss of ``loss_mode`` (``forward_kl_topk`` floored at 0 per
  token, since a top-k forward KL can go negative);
* ``loss_min`` / ``loss_max`` logged over valid tokens *before* clamping;
* every mode's per-token loss clamped to ±``loss_max_clamp``;
* policy-gradient use: the detached per-token loss is a penalty subtracted from
  the advantages (verl feeds ``-loss`` as the advantage of a vanilla PG loss);
* supervised use: the masked, aggregated, differentiable loss; for the
  vocabulary-wide modes it is computed by the reduced losses (the weights of
  ``loss_agg_mode`` are known before the forward pass, so the gradients are
  formed in it: 4 matmuls over N·H·V instead of 6), same value and gradient;
* ``distillation_loss_coef`` applied only together with task rewards.

It adds verl-omni's hidden-state modes (``nitrobrew``, ``nitrobrew_reverse_kl``,
with ``kd_temperature``), proctor's ``full_jsd`` / ``topk_reverse_kl`` /
``topk_jsd`` and ``student_topk_reverse_kl`` (the reverse KL on the student's top-k, with the
teacher's log-probs served at those ids; ``student_topk_form`` exact or renormalised), and LoongSage-style mixing: ``pg_ratio`` scales the advantage
penalty, ``gkd_ratio`` = λ mixes ``(1 - λ)·L_RL + λ·L_GKD``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Unpack

import torch

from .aggregate import aggregate, aggregate_weights
from .full_vocab import full_vocab_kl, full_vocab_kl_reduced
from .metrics import loss_metrics
from .options import AggregateOptions, DistillationInputs, check_keys
from .reduced import Reduced, Transform
from .sampled import sampled_kl
from .settings import LossSettings
from .student_topk import student_topk_masses, student_topk_reverse_kl
from .topk import topk_kl, topk_kl_reduced, topk_masses


class DistillationStepInputs(DistillationInputs, AggregateOptions, total=False):
    """``distillation_loss``'s keywords: the loss inputs and the aggregation's knobs."""


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


def _loss_call(
    s: LossSettings, inputs: dict[str, Any], weights: torch.Tensor | None = None, transform: Transform | None = None
) -> torch.Tensor | Reduced:
    """The raw per-token loss of ``s.loss_mode``, or with ``weights`` its reduced form.

    One place maps the settings onto the loss functions, so both paths compute the same
    loss. ``forward_kl_topk``'s floor at 0 is applied by the caller (per-token) or is part of
    ``transform`` (reduced).
    """
    student = {k: inputs.get(k) for k in ("student_hidden", "student_weight", "student_logits")}
    if s.is_sampled:
        if inputs.get("student_logprobs") is None or inputs.get("teacher_logprobs") is None:
            raise ValueError(f"loss_mode={s.loss_mode!r} needs student_logprobs and teacher_logprobs")
        return sampled_kl(inputs["student_logprobs"], inputs["teacher_logprobs"], s.loss_mode)
    reduced = {} if weights is None else {"weights": weights, "transform": transform}
    if s.is_student_topk:
        ids, lps = inputs.get("student_topk_ids"), inputs.get("teacher_score_logprobs")
        if ids is None or lps is None:
            raise ValueError(f"loss_mode={s.loss_mode!r} needs student_topk_ids and teacher_score_logprobs "
                             "(score the student's top-k with TeacherClient.score(score_ids=...))")
        return student_topk_reverse_kl(ids, lps, **student, form=s.student_topk_form, temperature=s.kd_temperature,
                                       chunk_tokens=s.chunk_tokens)
    if s.is_topk:
        ids, lps = inputs.get("teacher_topk_ids"), inputs.get("teacher_topk_logprobs")
        if ids is None or lps is None:
            raise ValueError(f"loss_mode={s.loss_mode!r} needs teacher_topk_ids and teacher_topk_logprobs")
        if s.loss_mode == "forward_kl_topk":
            # As verl: no temperature, clamp on both sides (floored at 0 per token by the caller).
            kw = dict(direction="forward", log_prob_min_clamp=s.log_prob_min_clamp)
        else:
            kw = dict(direction="reverse" if s.loss_mode == "topk_reverse_kl" else "jsd", beta=s.jsd_beta,
                      temperature=s.kd_temperature)
        if weights is None:
            return topk_kl(ids, lps, **student, **kw, chunk_tokens=s.chunk_tokens)
        return topk_kl_reduced(ids, lps, **student, **kw, chunk_tokens=s.chunk_tokens, **reduced)
    if inputs.get("teacher_hidden") is None or inputs.get("teacher_weight") is None:
        raise ValueError(f"loss_mode={s.loss_mode!r} needs teacher_hidden and teacher_weight")
    direction = {"nitrobrew": "forward", "nitrobrew_reverse_kl": "reverse", "full_jsd": "jsd"}[s.loss_mode]
    kw = dict(
        direction=direction, beta=s.jsd_beta, temperature=s.kd_temperature,
        log_prob_min_clamp=s.log_prob_min_clamp if direction == "forward" else None,
        chunk_tokens=s.chunk_tokens, chunk_vocab=s.chunk_vocab, teacher_index=inputs.get("teacher_index"),
    )
    fn = full_vocab_kl if weights is None else full_vocab_kl_reduced
    return fn(inputs["teacher_hidden"], inputs["teacher_weight"], **student, **kw, **reduced)


def _topk_floor(s: LossSettings, loss: torch.Tensor) -> torch.Tensor:
    """verl floors ``forward_kl_topk`` at 0 per token (a top-k forward KL can go negative)."""
    return loss.clamp_min(0.0) if s.loss_mode == "forward_kl_topk" else loss


def _max_clamp(s: LossSettings, loss: torch.Tensor) -> torch.Tensor:
    """verl's symmetric ``loss_max_clamp`` (k1 can be negative)."""
    if s.loss_max_clamp is None:
        return loss
    return loss.clamp(min=-float(s.loss_max_clamp), max=float(s.loss_max_clamp))


def _reduction_weights(
    s: LossSettings, inputs: dict[str, Any], mask: torch.Tensor | None, agg_kwargs: dict
) -> torch.Tensor | None:
    """``aggregate``'s per-token weights when the reduced path applies, else None.

    It applies to supervised use of the vocabulary-wide modes (hidden-state and top-k), whose
    aggregation is linear in the per-token loss given the mask. It does not where the weights
    are not finite (``aggregate`` divides by zero: no valid token), nor where the mask's shape
    is not the loss's: the per-token path then behaves, and fails, exactly as before.
    """
    if s.use_policy_gradient or not (s.is_hidden_state or s.is_topk):
        return None
    student = inputs.get("student_logits")
    if student is None:
        student = inputs.get("student_hidden")
    if not isinstance(student, torch.Tensor) or student.dim() != 2:
        return None
    n = student.shape[0]
    m = torch.ones(n, dtype=torch.bool, device=student.device) if mask is None else mask.to(student.device)
    if m.shape != (n,):
        return None
    dtype = torch.float64 if student.dtype == torch.float64 else torch.float32  # the losses' compute dtype
    weights = aggregate_weights(m, s.loss_agg_mode, dtype=dtype, **agg_kwargs)
    return weights if bool(torch.isfinite(weights).all()) else None


def _step_metrics(s: LossSettings, per_token: torch.Tensor, mask: torch.Tensor | None,
                  inputs: dict[str, Any]) -> dict[str, float]:
    """verl's loss metrics for the step: the masses on the top-k (teacher's or student's support)
    where the loss has one, and the mean |loss| of a sampled estimator."""
    student_mass = teacher_mass = None
    student = {name: inputs.get(name) for name in ("student_hidden", "student_weight", "student_logits")}
    if s.is_topk:
        student_mass, teacher_mass = topk_masses(
            inputs["teacher_topk_ids"], inputs["teacher_topk_logprobs"], **student, chunk_tokens=s.chunk_tokens,
            temperature=1.0 if s.loss_mode == "forward_kl_topk" else s.kd_temperature,
        )
    if s.is_student_topk:  # the masses on the student's support
        student_mass, teacher_mass = student_topk_masses(
            inputs["student_topk_ids"], inputs["teacher_score_logprobs"], **student,
            temperature=s.kd_temperature, chunk_tokens=s.chunk_tokens,
        )
    metrics = loss_metrics(per_token, mask, student_mass=student_mass, teacher_mass=teacher_mass)
    if s.is_sampled:
        valid = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask.bool()
        metrics["abs_loss"] = per_token.detach()[valid].abs().mean().item() if bool(valid.any()) else float("nan")
    return metrics


def distillation_loss(
    config: Any, *, mask: torch.Tensor | None = None, **given: Unpack[DistillationStepInputs]
) -> DistillationOutput:
    """Compute the distillation term of a training step as verl would.

    ``config``: verl's ``distillation_loss`` block (or the ``distillation``
    block), as a dict or an object. ``mask``: valid response tokens ``[N]``.
    ``student_topk_ids`` / ``teacher_score_logprobs`` ``[N, K]``: the student's support and the
    teacher's log-probs at it (``student_topk_reverse_kl``).
    The tensors (``DistillationInputs``) are those the loss mode needs; the ``AggregateOptions``
    (``seq_index``, ``dp_size``, ``batch_num_tokens``, ...) go to ``aggregate``.
    """
    check_keys(DistillationStepInputs, given, "distillation_loss")
    s = LossSettings.from_config(config)
    agg_kwargs = {k: v for k, v in given.items() if k in AggregateOptions.__optional_keys__}
    inputs: dict[str, Any] = {k: v for k, v in given.items() if k not in agg_kwargs}
    weights = _reduction_weights(s, inputs, mask, agg_kwargs)
    reduced = None
    if weights is not None:
        # Gradients formed in the forward pass: 4 matmuls over N·H·V instead of 6 or more.
        reduced = _loss_call(s, inputs, weights, transform=lambda x: _max_clamp(s, _topk_floor(s, x)))
        per_token = _topk_floor(s, reduced.per_token)
    else:
        per_token = _topk_floor(s, _loss_call(s, inputs))
    metrics = _step_metrics(s, per_token, mask, inputs)
    per_token = _max_clamp(s, per_token)
    if s.use_policy_gradient:
        scale = s.coefficient * (1.0 if s.pg_ratio is None else float(s.pg_ratio))
        penalty = per_token.detach() * scale
        if mask is not None:
            penalty = torch.where(mask.bool(), penalty, torch.zeros_like(penalty))
        return DistillationOutput(s, per_token, None, penalty, metrics)
    if reduced is not None:
        loss = reduced.total * s.coefficient
    else:
        loss = aggregate(per_token, mask, s.loss_agg_mode, **agg_kwargs) * s.coefficient
    metrics["loss_aggregated"] = float(loss.detach())
    return DistillationOutput(s, per_token, loss, None, metrics)
