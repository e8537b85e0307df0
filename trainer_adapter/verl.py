"""verl integration: proctor teachers behind the interface verl's agent loop calls.

The names trainers, configs and Ray use (`proctor.trainer_adapter.verl.ProctorAgentLoopManager`,
`...verl.patch_verl` as Ray's worker setup hook) live here; the code is in three modules, each
with one reason to change:

- `verl_layout`: verl's row layout of teacher answers (`verl_rows`, `pad_verl_rows`,
  `verl_teacher_batch`, `verl_hidden_rows`), for when verl's batch convention changes;
- `verl_client`: the client adapter (`ProctorTeacherClient`, `make_teacher_clients`,
  `ProctorTeacherModelManager`, `ProctorAgentLoopManager[TQ]`), for when proctor's client or
  verl's teacher-client interface changes;
- `verl_patch`: the reversible patches of verl internals (`patch_verl`, `unpatch_verl`), for
  when verl's trainers change; applied only on the verl release pyproject's table supports.

Wiring: see trainer_adapter/README.md. Importing this module does not import verl.
"""

from __future__ import annotations

from proctor.trainer_adapter import verl_client
from proctor.trainer_adapter.verl_client import (
    DEFAULT_TOKEN_ENV,
    ProctorTeacherClient,
    ProctorTeacherModelManager,
    VerlTokenOutput,
    make_teacher_clients,
    media_item,
    proctor_serves_teachers,
    teacher_unembeddings,
    verl_teacher_keys,
)
from proctor.trainer_adapter.verl_layout import pad_verl_rows, verl_hidden_rows, verl_rows, verl_teacher_batch
from proctor.trainer_adapter.verl_patch import VerlPatch, applied_patches, patch_verl, unpatch_verl

# ProctorAgentLoopManager[TQ] are left out: a star import would build them and so import verl.
__all__ = [
    "DEFAULT_TOKEN_ENV",
    "ProctorTeacherClient",
    "ProctorTeacherModelManager",
    "VerlPatch",
    "VerlTokenOutput",
    "applied_patches",
    "make_teacher_clients",
    "media_item",
    "pad_verl_rows",
    "patch_verl",
    "proctor_serves_teachers",
    "teacher_unembeddings",
    "unpatch_verl",
    "verl_hidden_rows",
    "verl_rows",
    "verl_teacher_batch",
    "verl_teacher_keys",
]


def __getattr__(name: str) -> type:
    """`ProctorAgentLoopManager` / `ProctorAgentLoopManagerTQ`, verl_client's (built on first use,
    so that importing this module does not import verl); the same class objects by either name."""
    if name in ("ProctorAgentLoopManager", "ProctorAgentLoopManagerTQ"):
        cls = getattr(verl_client, name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
