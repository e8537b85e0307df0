"""Startup checks for a teacher's engine settings: pure functions, no engine needed.

Each check raises `EngineConfigError` with a message that names the setting and says what to
change. The config loader can call them on the parsed `teacher_models.<name>.inference` block;
the vLLM engines call them again on what they are about to start (`check_vllm_settings`).
Settings are verl's names (`inference.max_model_len`, `inference.engine_kwargs.vllm.max_logprobs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proctor.server.engines.base import ENGINE_NAMES, EngineConfigError


def check_engine_name(name: str) -> None:
    """The engine must be one proctor has."""
    if name not in ENGINE_NAMES:
        raise EngineConfigError(
            f"inference.name is {name!r}: proctor has no such engine; choose one of {', '.join(ENGINE_NAMES)}"
        )


def check_device(device: str) -> None:
    """The device a teacher is placed on must be one this machine has (cuda: CUDA visible to
    torch; npu: torch-npu installed), checked before any replica starts."""
    import torch

    if device.startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device type)
        except ImportError:
            raise EngineConfigError("device 'npu' needs torch-npu: pip install 'proctor[npu]'") from None
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineConfigError(f"device {device!r} asked for, but CUDA is not available on this machine "
                                "(torch.cuda.is_available() is false): serve on --device cpu, or on a CUDA machine")
    elif not device.startswith(("cpu", "cuda", "npu")):
        raise EngineConfigError(f"device {device!r} is not one proctor places teachers on: cpu, cuda[:N] or npu[:N]")


def check_model_path(model_path: str | Path | None, *, download: bool = False) -> Path:
    """The teacher's local model directory (with a config.json), as a Path: `model_path` itself, or,
    for a Hugging Face id, its snapshot in the hub cache (`model_source`; fetched first when
    `download`, as `proctor serve` does, unless HF_HUB_OFFLINE=1)."""
    from proctor.server.engines.model_source import hub_snapshot, is_hub_id

    if not model_path:
        raise EngineConfigError("model_path is empty: set teacher_models.<name>.model_path to a model directory "
                                "or Hugging Face id")
    if is_hub_id(str(model_path)):
        path = hub_snapshot(str(model_path), download=download)
    else:
        path = Path(model_path).expanduser()
    if not path.exists():
        raise EngineConfigError(
            f"model_path {str(path)!r} does not exist: fix the path, or put a model there first "
            f"(a Hugging Face model: `hf download <org>/<name> --local-dir {path}`, or set model_path to the id "
            f"itself; a tiny random test teacher: `proctor make-tiny-model {path} [--seed N]`)"
        )
    if not path.is_dir():
        raise EngineConfigError(f"model_path {str(path)!r} is a file: point it at the model's directory")
    if not (path / "config.json").is_file():
        raise EngineConfigError(
            f"model_path {str(path)!r} has no config.json: point it at a Hugging Face model directory"
        )
    return path


def check_max_model_len(max_model_len: int, prompt_length: int, response_length: int) -> None:
    """The teacher replays prompt + response (+1 for the scoring step) in one sequence."""
    needed = prompt_length + response_length + 1
    if max_model_len < needed:
        raise EngineConfigError(
            f"inference.max_model_len is {max_model_len}, but the teacher replays prompt_length "
            f"({prompt_length}) + response_length ({response_length}) + 1 = {needed} tokens: raise "
            f"max_model_len to at least {needed} or shorten the student's sequences"
        )


def check_max_logprobs(max_logprobs: int, topk: int, *, engine: str = "vllm") -> None:
    """vLLM refuses prompt_logprobs above max_logprobs, so it must cover the top-k asked for."""
    if topk and max_logprobs < topk:
        raise EngineConfigError(
            f"inference.engine_kwargs.{engine}.max_logprobs is {max_logprobs}, below the top-k "
            f"served ({topk}): raise max_logprobs to at least {topk} or lower the top-k"
        )


def check_hidden_states_prefill(enable_chunked_prefill: bool) -> None:
    """Hidden states come from whole prefills: chunked prefill must be off."""
    if enable_chunked_prefill:
        raise EngineConfigError(
            "inference.enable_chunked_prefill is true, but hidden states are served: vLLM returns them "
            "only for whole (unchunked) prefills; set enable_chunked_prefill=false "
            "(or inference.hidden_states=false if no loss needs them)"
        )


def check_batched_tokens(max_num_batched_tokens: int, prompt_length: int, response_length: int) -> None:
    """Without chunked prefill a whole sequence must fit in one scheduler step."""
    longest = prompt_length + response_length
    if max_num_batched_tokens < longest:
        raise EngineConfigError(
            f"inference.max_num_batched_tokens is {max_num_batched_tokens}, below the longest scored "
            f"sequence (prompt_length + response_length = {longest}): without chunked prefill a whole "
            f"sequence is one step; raise max_num_batched_tokens to at least {longest}"
        )


def check_vllm_settings(
    settings: Mapping[str, Any],
    *,
    topk: int,
    max_logprobs: int,
    hidden_states: bool,
    engine: str = "vllm",
) -> None:
    """Every check that applies to a vLLM-family teacher, on its `inference` settings.

    `prompt_length` / `response_length` are checked against the other settings only where
    given (verl always gives them; a bare CLI spec may not).
    """
    prompt_length = settings.get("prompt_length")
    response_length = settings.get("response_length")
    have_lengths = prompt_length is not None and response_length is not None
    max_model_len = settings.get("max_model_len")
    if have_lengths and max_model_len is not None:
        check_max_model_len(int(max_model_len), int(prompt_length), int(response_length))
    check_max_logprobs(max_logprobs, topk, engine=engine)
    if hidden_states:
        check_hidden_states_prefill(bool(settings.get("enable_chunked_prefill", False)))
        batched = settings.get("max_num_batched_tokens")
        if have_lengths and batched is not None:
            check_batched_tokens(int(batched), int(prompt_length), int(response_length))


def refuse(message: str) -> None:
    """A config-only problem found by the serving plan, reported like the engine checks."""
    raise EngineConfigError(message)
