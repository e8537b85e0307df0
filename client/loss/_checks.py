"""Argument validation shared by every loss family.

Every public loss validates its inputs up front so that a wrong shape or a
forgotten argument fails with a ``ValueError`` naming the argument, instead of
surfacing later as an opaque matmul or gather error deep inside a chunk loop.
"""

from __future__ import annotations

import torch

DIRECTIONS = ("forward", "reverse", "jsd")


def require_2d(name: str, t: torch.Tensor) -> None:
    """Raise unless ``t`` is a 2-D tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def require_float(name: str, t: torch.Tensor) -> None:
    """Raise unless ``t`` holds floating-point values."""
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def check_student(
    student_hidden: torch.Tensor | None,
    student_weight: torch.Tensor | None,
    student_logits: torch.Tensor | None,
    num_tokens: int | None,
) -> tuple[int, int]:
    """Validate the student side (fused pair xor logits) and return ``(N, V)``.

    ``num_tokens`` is the N the other inputs imply, or None when the student
    side defines it.
    """
    fused = student_hidden is not None or student_weight is not None
    if fused and student_logits is not None:
        raise ValueError(
            "give the student either as (student_hidden, student_weight) or as student_logits, not both"
        )
    if not fused and student_logits is None:
        raise ValueError(
            "the student is missing: give (student_hidden, student_weight) or student_logits"
        )
    if fused:
        if student_hidden is None:
            raise ValueError("student_hidden is required with student_weight")
        if student_weight is None:
            raise ValueError("student_weight is required with student_hidden")
        require_2d("student_hidden", student_hidden)
        require_2d("student_weight", student_weight)
        require_float("student_hidden", student_hidden)
        require_float("student_weight", student_weight)
        if student_hidden.shape[1] != student_weight.shape[1]:
            raise ValueError(
                f"student_hidden has hidden size {student_hidden.shape[1]} but student_weight "
                f"[V, H] has {student_weight.shape[1]}"
            )
        n, v = student_hidden.shape[0], student_weight.shape[0]
        name = "student_hidden"
    else:
        assert student_logits is not None
        require_2d("student_logits", student_logits)
        require_float("student_logits", student_logits)
        n, v = student_logits.shape
        name = "student_logits"
    if num_tokens is not None and n != num_tokens:
        raise ValueError(f"{name} has {n} tokens but the teacher inputs have {num_tokens}")
    if v == 0:
        raise ValueError(f"{name} implies an empty vocabulary")
    return n, v


def check_id_table(ids_name: str, ids: torch.Tensor, values_name: str, values: torch.Tensor) -> None:
    """Raise unless ``ids`` and float ``values`` are 2-D tables ``[N, K]`` of one shape with k > 0."""
    require_2d(ids_name, ids)
    require_2d(values_name, values)
    require_float(values_name, values)
    if ids.shape != values.shape:
        raise ValueError(f"{ids_name} has shape {tuple(ids.shape)} but {values_name} has {tuple(values.shape)}")
    if ids.shape[1] == 0:
        raise ValueError(f"{ids_name} has k = 0 columns")


def check_options(
    direction: str, beta: float, temperature: float, clamp: float | None, chunk_tokens: int | None
) -> None:
    """The options every divergence entry takes: direction and beta, temperature, clamp, chunk_tokens."""
    check_direction(direction, beta)
    check_temperature(temperature)
    check_clamp(clamp, direction)
    check_chunk("chunk_tokens", chunk_tokens)


def check_direction(direction: str, beta: float) -> None:
    """Raise on an unknown direction or a JSD beta outside [0, 1]."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if direction == "jsd" and not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must lie in [0, 1] for direction='jsd', got {beta}")


def check_temperature(temperature: float) -> None:
    """Raise unless the temperature is a positive finite number."""
    if not (float(temperature) > 0.0 and float(temperature) != float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")


def check_clamp(log_prob_min_clamp: float | None, direction: str) -> None:
    """The floor is defined for the forward KL only (as in verl); refuse it elsewhere."""
    if log_prob_min_clamp is not None and direction != "forward":
        raise ValueError(
            f"log_prob_min_clamp applies to direction='forward' only, got direction={direction!r}"
        )


def check_chunk(name: str, value: int | None) -> None:
    """Raise unless a chunk size is None or a positive integer."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def check_ids(name: str, ids: torch.Tensor, vocab: int) -> None:
    """Raise unless ``ids`` is an integer tensor with every id in ``[0, vocab)``."""
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{name} has ids in [{lo}, {hi}] but the vocabulary size is {vocab}")
