"""The teacher side of the full-vocabulary losses: validation, and grouping tokens by teacher.

Multi-teacher batches give one ``[V, H_j]`` unembedding per teacher (``None`` for a teacher
without one) and ``teacher_index [N]``. The loss itself is a single-teacher pass; grouping its
tokens by teacher, and scattering the per-token results back, is this module's only job, so
the per-token and the reduced entry share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from proctor.proto import hidden_forms

from . import _checks


def check_teachers(teacher_hidden: torch.Tensor, teacher_weight, teacher_index, vocab: int) -> list:
    """Validate the teacher side; return the list of per-teacher weights. ``teacher_hidden`` may be
    float, or packed fp8 rows (uint8 ``[N, H + 4]``, `proctor.proto.hidden_forms`: width H)."""
    _checks.require_2d("teacher_hidden", teacher_hidden)
    if not hidden_forms.is_fp8_rows(teacher_hidden):
        _checks.require_float("teacher_hidden", teacher_hidden)
    width = hidden_forms.width(teacher_hidden)
    weights = list(teacher_weight) if isinstance(teacher_weight, Sequence) else [teacher_weight]
    if teacher_index is None and len(weights) != 1:
        raise ValueError("teacher_index is required when teacher_weight lists several teachers")
    if not weights:
        raise ValueError("teacher_weight is empty")
    for j, w in enumerate(weights):
        if w is None:
            continue
        name = "teacher_weight" if len(weights) == 1 else f"teacher_weight[{j}]"
        _checks.require_2d(name, w)
        _checks.require_float(name, w)
        if w.shape[0] != vocab:
            raise ValueError(f"{name} has vocabulary {w.shape[0]} but the student has {vocab}")
        if w.shape[1] > width:
            raise ValueError(f"{name} has hidden size {w.shape[1]} but teacher_hidden has only {width}")
        if len(weights) == 1 and w.shape[1] != width:
            raise ValueError(f"teacher_hidden has hidden size {width} but teacher_weight has {w.shape[1]}")
    return weights


def by_teacher(
    t_hidden: torch.Tensor,
    weights: list,
    teacher_index: torch.Tensor | None,
    student: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    run: Callable,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``run(student, teacher_hidden, teacher_weight, rows)`` once (rows None), or once per teacher group.

    Multi-teacher: tokens are grouped by teacher, each group runs one chunked pass, the
    per-token losses are scattered back and the reduced totals (if any) summed.
    """
    if teacher_index is None:
        return run(student, t_hidden, weights[0].detach(), None)
    n = t_hidden.shape[0]
    if not isinstance(teacher_index, torch.Tensor) or teacher_index.shape != (n,):
        shape = tuple(teacher_index.shape) if isinstance(teacher_index, torch.Tensor) else None
        raise ValueError(f"teacher_index must be a tensor of shape ({n},), got {shape}")
    _checks.check_ids("teacher_index", teacher_index, len(weights))
    index = teacher_index.to(device=t_hidden.device, dtype=torch.long)
    student_hidden, student_weight, student_logits = student
    out = torch.zeros(n, dtype=dtype, device=t_hidden.device)
    pieces, total = [], None
    for j in torch.unique(index).tolist():
        w = weights[j]
        if w is None:
            raise ValueError(f"teacher_index selects teacher {j}, whose teacher_weight is None")
        rows = (index == j).nonzero(as_tuple=True)[0]
        th = t_hidden.index_select(0, rows)
        th = (hidden_forms.dequantize_rows(th, dtype) if hidden_forms.is_fp8_rows(th) else th)[:, : w.shape[1]]
        if student_logits is not None:
            sub = (None, None, student_logits.index_select(0, rows))
        else:
            assert student_hidden is not None
            sub = (student_hidden.index_select(0, rows), student_weight, None)
        part, part_total = run(sub, th, w.detach(), rows)
        if part_total is not None:
            total = part_total if total is None else total + part_total
        pieces.append((rows, part))
    for rows, part in pieces:
        out = out.index_put((rows,), part)
    return out, total
