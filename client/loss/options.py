"""The keyword options the loss functions share, stated once with their defaults.

Every vocabulary-wide loss takes the student the same way (its last hidden states and lm_head
weight, or its logits) and most take the same divergence knobs. Each public function names
which of them it accepts by a ``TypedDict`` (``**options: Unpack[...]``: type checkers see the
keys), and ``read_options`` turns the given ones into a ``LossOptions`` with the defaults
filled in. So a default (``beta=0.5``, say) lives here and nowhere else, and a misspelt
option is a ``TypeError`` as it would be for a plain keyword argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

import torch


class StudentInputs(TypedDict, total=False):
    """The student: ``student_hidden [N, H]`` with ``student_weight [V, H]`` (no ``[N, V]``
    logits are formed), or ``student_logits [N, V]``."""

    student_hidden: torch.Tensor | None
    student_weight: torch.Tensor | None
    student_logits: torch.Tensor | None


class SupportOptions(StudentInputs, total=False):
    """``temperature`` divides the logits; ``chunk_tokens`` rows are held at a time."""

    temperature: float
    chunk_tokens: int | None


class DivergenceOptions(SupportOptions, total=False):
    """``direction``: forward / reverse / jsd (``beta`` mixes the JSD; 0 → forward, 1 → reverse);
    ``log_prob_min_clamp`` floors log p_S in the forward KL."""

    direction: str
    beta: float
    log_prob_min_clamp: float | None


class FullVocabOptions(DivergenceOptions, total=False):
    """``chunk_vocab``: vocabulary tile width; ``teacher_index [N]``: which teacher scores token n."""

    chunk_vocab: int | None
    teacher_index: torch.Tensor | None


class StudentTopKOptions(SupportOptions, total=False):
    """``form``: ``exact`` (the full reverse KL's terms on the support) or ``renormalised``."""

    form: str


class AggregateOptions(TypedDict, total=False):
    """verl's ``agg_loss`` knobs: ``seq_index [N]`` (a packed token's sequence), ``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``."""

    seq_index: torch.Tensor | None
    dp_size: int
    batch_num_tokens: float | torch.Tensor | None
    global_batch_size: float | torch.Tensor | None
    loss_scale_factor: float | None


class SampledInputs(TypedDict, total=False):
    """The sampled estimators' inputs: both log-probs of the sampled tokens ``[N]``."""

    student_logprobs: torch.Tensor | None
    teacher_logprobs: torch.Tensor | None


class TeacherTopKInputs(TypedDict, total=False):
    """The teacher's top-k as served: ids and log-probs ``[N, K]``."""

    teacher_topk_ids: torch.Tensor | None
    teacher_topk_logprobs: torch.Tensor | None


class TeacherHiddenInputs(TypedDict, total=False):
    """The teacher's last hidden states ``[N, H]``, its unembedding (one per teacher) and
    ``teacher_index [N]`` for several teachers."""

    teacher_hidden: torch.Tensor | None
    teacher_weight: Any
    teacher_index: torch.Tensor | None


class StudentSupportInputs(TypedDict, total=False):
    """The student's support ``[N, K]`` and the teacher's log-probs at it."""

    student_topk_ids: torch.Tensor | None
    teacher_score_logprobs: torch.Tensor | None


class DistillationInputs(
    StudentInputs, SampledInputs, TeacherTopKInputs, TeacherHiddenInputs, StudentSupportInputs, total=False
):
    """Everything ``distillation_loss`` may read; a loss mode uses the part it needs."""


@dataclass(frozen=True)
class LossOptions:
    """All the options with their defaults; a function reads only those it accepts."""

    student_hidden: torch.Tensor | None = None
    student_weight: torch.Tensor | None = None
    student_logits: torch.Tensor | None = None
    direction: str = "forward"
    beta: float = 0.5
    temperature: float = 1.0
    log_prob_min_clamp: float | None = None
    chunk_tokens: int | None = None
    chunk_vocab: int | None = None
    teacher_index: torch.Tensor | None = None
    form: str = "exact"

    @property
    def student(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(hidden, weight, logits)``, the order the chunking core takes them in."""
        return self.student_hidden, self.student_weight, self.student_logits


def check_keys(accepted: type, given: dict[str, Any], function: str) -> None:
    """A key the ``accepted`` TypedDict does not list is a TypeError, as for a plain keyword."""
    unknown = sorted(set(given) - (accepted.__required_keys__ | accepted.__optional_keys__))
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword argument(s): {', '.join(unknown)}")


def read_options(accepted: type, given: dict[str, Any], function: str) -> LossOptions:
    """``given`` (checked against ``accepted``) with the defaults filled in."""
    check_keys(accepted, given, function)
    return LossOptions(**given)


__all__ = [
    "AggregateOptions",
    "DistillationInputs",
    "DivergenceOptions",
    "FullVocabOptions",
    "LossOptions",
    "StudentInputs",
    "StudentTopKOptions",
    "SupportOptions",
    "check_keys",
    "read_options",
]
