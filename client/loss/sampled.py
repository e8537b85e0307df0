"""Single-sample KL estimators on the sampled token (Schulman's k1 / k2 / k3).

Each needs only the student's and the teacher's log-prob of the token the
student actually sampled, so they are the cheapest signal OPD can use. They
follow verl's ``kl_penalty`` exactly, including its clamps for ``k3``.
"""

from __future__ import annotations

import torch

from proctor.proto.loss_modes import SAMPLED_MODES

from . import _checks

# verl clamps the k3 log-ratio and its result for numerical stability.
K3_RATIO_CLAMP = 20.0
K3_RESULT_CLAMP = 10.0


def sampled_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token estimator, float32 (float64 for float64 inputs) with the inputs' shape, differentiable in ``student_logprobs``.

    ``kl``/``k1`` = s - t; ``abs`` = |s - t|; ``mse``/``k2`` = ½(s - t)²;
    ``low_var_kl``/``k3`` = e^r - r - 1 with r = t - s clamped to ±20, result to ±10.
    """
    if mode not in SAMPLED_MODES:
        raise ValueError(f"mode must be one of {SAMPLED_MODES}, got {mode!r}")
    for name, x in (("student_logprobs", student_logprobs), ("teacher_logprobs", teacher_logprobs)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _checks.require_float(name, x)
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs has shape {tuple(student_logprobs.shape)} but teacher_logprobs has "
            f"{tuple(teacher_logprobs.shape)}"
        )
    dtype = torch.float64 if student_logprobs.dtype == torch.float64 else torch.float32
    s = student_logprobs.to(dtype)
    t = teacher_logprobs.detach().to(dtype)
    if mode in ("kl", "k1"):
        return s - t
    if mode == "abs":
        return (s - t).abs()
    if mode in ("mse", "k2"):
        return 0.5 * (s - t).square()
    r = torch.clamp(t - s, min=-K3_RATIO_CLAMP, max=K3_RATIO_CLAMP)
    return torch.clamp(torch.exp(r) - r - 1.0, min=-K3_RESULT_CLAMP, max=K3_RESULT_CLAMP)
