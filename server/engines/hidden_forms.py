"""Hidden states in the request's wire form, computed where the engine holds them: the one module
every engine (torch, vLLM's scoring pooler, vLLM-Omni) calls, so the forms mean the same everywhere.

A teacher serves the forms of `proctor.proto.hidden_forms`; the projected ones only when
`inference.hidden_projection_rank` (r) is set. Its projection `P [H, r]` is fixed per teacher and
computed once at start from the unembedding `W [V, H]`: the top-r right singular vectors of W
(eigenvectors of the Gram matrix WᵀW in float64, in descending order, each column's largest entry
made positive, so every process computing it from the same weights gets the same P). Then
`(h·P)·(W·P)ᵀ = h·(P·Pᵀ)·Wᵀ` are the logits of h projected onto W's top-r row space, which is
where the logits vary most: the captured energy `Σ_{i≤r} σ_i² / Σ σ_i²` is the share of
`‖W·h‖²` over an isotropic h that the projection keeps, logged at start and listed in ListTeachers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from proctor.proto import hidden_forms as wire
from proctor.server.engines.base import EngineConfigError

log = logging.getLogger(__name__)

RANK_SETTING = "hidden_projection_rank"
_GRAM_ROWS = 8192  # unembedding rows per Gram-matrix step (bounds the float64 copy)


@dataclass(frozen=True)
class Projection:
    """A teacher's projection: `matrix` P float32 [H, r] and the energy of W it keeps."""

    matrix: torch.Tensor
    energy: float

    @property
    def rank(self) -> int:
        return int(self.matrix.shape[1])


def projection_of(weight: torch.Tensor, rank: int) -> Projection:
    """P [H, r] from the unembedding's SVD (module docstring), on the CPU in float64."""
    vocab, hidden = int(weight.shape[0]), int(weight.shape[1])
    if not 0 < rank <= hidden:
        raise EngineConfigError(f"inference.{RANK_SETTING}: {rank} is not in 1..{hidden} (the hidden size)")
    gram = torch.zeros(hidden, hidden, dtype=torch.float64)
    for start in range(0, vocab, _GRAM_ROWS):
        rows = weight[start : start + _GRAM_ROWS].detach().to("cpu", torch.float64)
        gram.addmm_(rows.T, rows)
    values, vectors = torch.linalg.eigh(gram)  # ascending
    top = vectors[:, -rank:].flip(1)
    pivot = top.abs().argmax(dim=0)
    top = top * torch.sign(top[pivot, torch.arange(rank)])
    total = float(values.clamp(min=0).sum())
    energy = float(values[-rank:].clamp(min=0).sum()) / total if total > 0 else 1.0
    return Projection(top.to(torch.float32).contiguous(), energy)


def compress(hidden: torch.Tensor, form: str, projection: torch.Tensor | None) -> torch.Tensor:
    """Rows [R, H] (on their device) in `form`: "" as they are, a float cast, fp8 rows, or projected
    by `projection` P [H, r] (float32 h·P, then fp8 rows for "projected_fp8"). Stays on the device."""
    if form == wire.EXACT:
        return hidden
    if form in wire.PROJECTED_FORMS:
        if projection is None:
            raise ValueError(f"hidden_form {form!r} needs the teacher's projection")
        hidden = hidden.float() @ projection.to(hidden.device)
    if form in wire.FP8_FORMS:
        return wire.quantize_rows(hidden)
    if form == wire.BFLOAT16:
        return hidden.to(torch.bfloat16)
    return hidden.float()


@dataclass
class HiddenForms:
    """One teacher's hidden-state forms: what it offers and the projection they use."""

    projection: Projection | None = None
    _file: str | None = field(default=None, repr=False)

    @classmethod
    def start(cls, settings: Mapping[str, Any] | None, unembedding: Any, teacher: str = "") -> HiddenForms:
        """The forms of a teacher with `settings` (its `inference` block); `unembedding` (a tensor or
        a function returning one) is read only when a projection rank is set."""
        rank = int((settings or {}).get(RANK_SETTING) or 0)
        if rank <= 0:
            return cls()
        weight = unembedding() if callable(unembedding) else unembedding
        projection = projection_of(weight, rank)
        log.info("%s: hidden-state projection r=%d of H=%d keeps %.4f of the unembedding's energy",
                 teacher or "teacher", rank, int(weight.shape[1]), projection.energy)
        return cls(projection)

    @property
    def offered(self) -> tuple[str, ...]:
        return tuple(f for f in wire.FORMS if self.projection is not None or f not in wire.PROJECTED_FORMS)

    def info_fields(self) -> dict[str, Any]:
        """EngineInfo's fields about the forms."""
        p = self.projection
        return {"hidden_forms": self.offered, "projection_rank": 0 if p is None else p.rank,
                "projection_energy": None if p is None else p.energy}

    def compress(self, hidden: torch.Tensor, form: str) -> torch.Tensor:
        return compress(hidden, form, None if self.projection is None else self.projection.matrix)

    def shrink(self, outcome: Any, request: Any) -> Any:
        """An engine's outcome for `request` with its hidden states in the request's form (outcomes
        that are not results, and results without hidden states, pass as they are): for an engine
        whose hidden states reach it whole (vLLM-Omni's stage output)."""
        hidden = getattr(outcome, "hidden_states", None)
        if hidden is not None and request.hidden_form:
            outcome.hidden_states = self.compress(hidden, request.hidden_form).to("cpu")
        return outcome

    def projected_unembedding(self, weight: torch.Tensor) -> torch.Tensor:
        """W·P float32 [V, r], what a client rebuilds projected logits with."""
        if self.projection is None:
            raise ValueError("this teacher has no hidden-state projection")
        return weight.float() @ self.projection.matrix

    def projection_file(self) -> str:
        """P saved once to a file of its own, for a process that loads it by path (vLLM's pooler)."""
        if self.projection is None:
            return ""
        if self._file is None:
            handle, path = tempfile.mkstemp(prefix="proctor-projection-", suffix=".pt")
            os.close(handle)
            torch.save(self.projection.matrix, path)
            self._file = path
        return self._file

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file)
            self._file = None


_PROJECTED_KEPT: dict[tuple[str, int], torch.Tensor] = {}
_PROJECTED_TEACHERS = 4  # W·P kept for this many (weights, rank) pairs


def projected_unembedding(weight: torch.Tensor, rank: int, fingerprint: str) -> torch.Tensor:
    """W·P [V, r] for the front, P computed from `weight` by `projection_of` (the engines' rule, so the
    same weights give the same P); kept per weights' `fingerprint` and rank: one SVD per teacher."""
    key = (fingerprint, rank)
    if key not in _PROJECTED_KEPT:
        while len(_PROJECTED_KEPT) >= _PROJECTED_TEACHERS:
            _PROJECTED_KEPT.pop(next(iter(_PROJECTED_KEPT)))
        _PROJECTED_KEPT[key] = weight.float() @ projection_of(weight, rank).matrix
    return _PROJECTED_KEPT[key]


@functools.lru_cache(maxsize=8)
def _loaded(path: str, device: str) -> torch.Tensor:
    return torch.load(path, map_location=device, weights_only=True)


def compress_with_file(hidden: torch.Tensor, form: str, projection_file: str) -> torch.Tensor:
    """`compress` where P is read (once per process and device) from `projection_file`."""
    matrix = _loaded(projection_file, str(hidden.device)) if form in wire.PROJECTED_FORMS and projection_file else None
    return compress(hidden, form, matrix)
