"""proctor's renormalised top-k losses where verl computes its top-k loss: the logits processor.

verl 0.9 computes `forward_kl_topk` inside the actor's forward pass (`compute_topk_loss`, called
by `distillation_ppo_loss` as a logits processor) from the student's logits and the teacher's
top-k (`teacher_ids` / `teacher_logprobs`, nested per sequence), then turns the per-token
losses and masses into its loss and metrics in the registered loss function. LoongSage's
reverse KL and JSD on the teacher's top-k, renormalised on both sides (`topk_reverse_kl`,
`topk_jsd`), are proctor's `topk_kl(direction="reverse" | "jsd")`; this module computes them
on exactly the tensors verl hands its own top-k loss, so the rest of verl's path (all-gather
across sequence-parallel ranks, aggregation, `distillation/*` metrics) runs unchanged.
`patch_verl()` wires it in; nothing here imports verl at module level.
"""

from __future__ import annotations

from typing import Any

import torch

from proctor.client.loss.topk import topk_kl, topk_masses
from proctor.proto.loss_modes import LOSS_SETTINGS

# proctor's top-k modes that verl lacks → topk_kl's direction.
VERL_EXTRA_TOPK_MODES = {"topk_reverse_kl": "reverse", "topk_jsd": "jsd"}
# Strategies whose logits processor sees the whole vocabulary per token (FSDP's, and VeOmni's,
# which is FSDP2 underneath); Megatron shards it over tensor-parallel ranks.
_FULL_VOCAB_STRATEGIES = ("fsdp", "fsdp2", "veomni")


def _flat_teacher(tensor: torch.Tensor) -> torch.Tensor:
    """verl's nested (per-sequence) teacher tensor as [1, total_tokens, K], the student's layout."""
    return tensor.values().unsqueeze(0) if tensor.is_nested else tensor


def topk_outputs(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    loss_mode: str,
    *,
    jsd_beta: float = LOSS_SETTINGS["jsd_beta"],
) -> dict[str, torch.Tensor]:
    """Per-token loss and the two top-k masses, each [bsz, seqlen] like the student's logits
    [bsz, seqlen, V]: what verl's top-k logits processor returns for `forward_kl_topk`."""
    logprobs, ids = _flat_teacher(teacher_topk_logprobs), _flat_teacher(teacher_topk_ids)
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    if get_ulysses_sequence_parallel_world_size() > 1:  # this rank's slice of the sequence, as verl does
        logprobs, ids = slice_input_tensor(logprobs, dim=1), slice_input_tensor(ids, dim=1)
    shape = student_logits.shape[:2]
    if logprobs.shape[:2] != shape or ids.shape[:2] != shape:
        raise ValueError(f"teacher top-k {tuple(logprobs.shape)} does not line up with student logits "
                         f"{tuple(student_logits.shape)}")
    logits = student_logits.reshape(-1, student_logits.shape[-1])
    flat_ids = ids.reshape(-1, ids.shape[-1]).long()
    flat_logprobs = logprobs.reshape(-1, logprobs.shape[-1])
    loss = topk_kl(flat_ids, flat_logprobs, student_logits=logits, direction=VERL_EXTRA_TOPK_MODES[loss_mode],
                   beta=jsd_beta)
    student_mass, teacher_mass = topk_masses(flat_ids, flat_logprobs, student_logits=logits)
    return {"distillation_losses": loss.reshape(shape), "student_mass": student_mass.reshape(shape),
            "teacher_mass": teacher_mass.reshape(shape)}


def with_proctor_topk_modes(verl_compute_topk_loss: Any) -> Any:
    """verl's `compute_topk_loss`, extended: proctor's modes computed here, the rest as verl does."""

    def compute_topk_loss(config, distillation_config, data, student_logits, data_format):
        loss_mode = distillation_config.distillation_loss.loss_mode
        if loss_mode not in VERL_EXTRA_TOPK_MODES:
            return verl_compute_topk_loss(config, distillation_config, data, student_logits, data_format)
        if config.strategy not in _FULL_VOCAB_STRATEGIES:
            raise NotImplementedError(
                f"distillation_loss.loss_mode={loss_mode} runs on the {'/'.join(_FULL_VOCAB_STRATEGIES)} "
                f"strategies (the whole vocabulary per token); {config.strategy} shards it: use forward_kl_topk"
            )
        return topk_outputs(student_logits, data["teacher_logprobs"], data["teacher_ids"], loss_mode)

    compute_topk_loss.__proctor__ = True  # type: ignore[attr-defined]
    compute_topk_loss.__wrapped__ = verl_compute_topk_loss  # type: ignore[attr-defined]
    compute_topk_loss.__doc__ = verl_compute_topk_loss.__doc__
    return compute_topk_loss
