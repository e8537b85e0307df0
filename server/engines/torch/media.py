"""The torch engine's multimodal half: a transformers VL / Omni-Thinker model and its processor.

Why a module of its own: text batches go through the decoder body in one padded pass
(`torch.engine`), but a request with media needs the full model (vision tower, audio encoder,
their embeddings merged at the placeholder positions, M-RoPE positions from the media grids),
so it runs its own forward with the inputs the model directory's own processor makes from the
decoded media, the reference path of these models (and what runs on an NPU with torch-npu).

Only the media go through the processor: the token ids are the rollout's, as sent. The
processor is asked to expand one placeholder per item, which yields both the media tensors
(pixel values and grids, audio features) and the run length it makes for each item, checked
against the sent ids (`multimodal.check_runs`) before anything is scored. `mm_token_type_ids`
(Qwen2-VL's M-RoPE needs them) are built from the sent ids by the processor's own rule.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from proctor.server.engines.base import EngineError, EngineRequest, RequestRejected
from proctor.server.engines.media import MM_KEYS
from proctor.server.engines.multimodal import (
    Placeholders,
    check_counts,
    check_runs,
    decoded_media,
    run_lengths,
)
from proctor.server.engines.token_ids import index_tensor
from proctor.server.engines.torch.loading import build

# Architectures whose checkpoint wraps the scoring model: the Omni models' Thinker.
_WRAPPED = {"Qwen2_5OmniForConditionalGeneration": "thinker", "Qwen3OmniMoeForConditionalGeneration": "thinker"}
_PROCESSOR_ARGS = {"images": "images", "videos": "videos", "audios": "audio"}
_PROCESSOR_TOKENS = {"images": "image_token", "videos": "video_token", "audios": "audio_token"}


def is_multimodal(model_path: str | Path) -> bool:
    return bool(Placeholders.of_model(model_path).token_ids)


def load_multimodal_model(path: Path, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The scoring model of a multimodal checkpoint (the Thinker of an Omni model)."""
    import transformers

    architecture = (getattr(config, "architectures", None) or [""])[0]
    if architecture in _WRAPPED:
        wrapper = build(getattr(transformers, architecture).from_pretrained, path, local_files_only=True, dtype=dtype)
        return getattr(wrapper, _WRAPPED[architecture])
    return build(transformers.AutoModelForImageTextToText.from_pretrained, path, local_files_only=True, dtype=dtype)


@dataclass
class PreparedMedia:
    """A request's processor outputs, ready for the model's forward."""

    inputs: dict[str, Any]


class TorchMedia:
    """The model directory's processor, the placeholder rule, and the per-request forward."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoProcessor

        self.placeholders = Placeholders.of_model(model_path)
        self.processor = AutoProcessor.from_pretrained(model_path, local_files_only=True)
        self._lock = threading.Lock()  # processors keep per-call state in places

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.placeholders.kinds

    def prepare(self, request: EngineRequest) -> PreparedMedia | RequestRejected:
        """The processor's inputs for a request's media, or the request error that stops it."""
        problem = check_counts(request, self.placeholders)
        if problem is not None:
            return problem
        kinds = request.media.kinds()
        data = decoded_media(request)
        # One placeholder per item, each on its own line: adjacent ones would expand into one run.
        template = "\n".join(getattr(self.processor, _PROCESSOR_TOKENS[kind])
                              for kind in kinds for _ in getattr(request.media, kind))
        arguments: dict[str, Any] = {}
        for kind in kinds:
            items = data[MM_KEYS[kind]]
            if kind == "videos":  # (frames, metadata) from a container; the frames from .npy
                items = [item[0] if isinstance(item, tuple) else item for item in items]
            if kind == "audios":
                rates = {rate for _, rate in items}
                arguments["sampling_rate"] = rates.pop() if len(rates) == 1 else None
                items = [np.asarray(wave, dtype=np.float32) for wave, _ in items]
                if arguments["sampling_rate"] is None:
                    return RequestRejected("audios", "the clips of one request must share one sample rate")
            arguments[_PROCESSOR_ARGS[kind]] = items
        kwargs = dict(request.media.processor_kwargs) if request.media else {}
        try:
            with self._lock:
                out = self.processor(text=[template], return_tensors="pt", **arguments, **kwargs)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
            field = f"{kinds[0]}[0]" if len(kinds) == 1 else "media"
            return RequestRejected(field, f"the model's processor rejects it: {exc}")
        expected = run_lengths(out["input_ids"][0].tolist(), self.placeholders, kinds)
        problem = check_runs(request, self.placeholders, expected)
        if problem is not None:
            return problem
        inputs = {key: value for key, value in out.items() if key not in ("input_ids", "attention_mask",
                                                                          "mm_token_type_ids")}
        if "mm_token_type_ids" in out:
            types = self.processor.create_mm_token_type_ids([request.token_ids.tolist()])
            inputs["mm_token_type_ids"] = torch.tensor(types, dtype=torch.long)
        return PreparedMedia(inputs)

    @staticmethod
    def states(model: torch.nn.Module, request: EngineRequest, prepared: PreparedMedia) -> torch.Tensor | RequestRejected:
        """Rows first_row..T-1 of the last layer's (normed) hidden states, from the model's full
        multimodal forward; read off the decoder's output, so the lm_head's [T, V] logits of
        the model's own forward are limited to one position where the model allows it."""
        device = next(model.parameters()).device
        captured: list[torch.Tensor] = []

        def keep(_module, _args, output):
            captured.append(output.last_hidden_state)

        handle = model.get_decoder().register_forward_hook(keep)
        try:
            ids = index_tensor(request.token_ids)[None].to(device)
            dtype = next(model.parameters()).dtype
            inputs = {key: _to_model(value, device, dtype) for key, value in prepared.inputs.items()}
            extra = {"logits_to_keep": 1} if "logits_to_keep" in _forward_args(type(model)) else {}
            try:
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **inputs, **extra)
            except (ValueError, IndexError) as exc:  # the model's own input checks (positions, markers)
                return RequestRejected("token_ids", f"the model cannot place this sequence's media: {exc}")
        finally:
            handle.remove()
        if len(captured) != 1:
            raise EngineError(f"the model's decoder ran {len(captured)} times for one request")
        hidden = captured[0][0]
        return hidden[request.first_row - 1 : request.num_tokens - 1]


def _to_model(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Processor outputs on the model's device; pixel values and audio features in its dtype."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)


@functools.cache
def _forward_args(model_class: type) -> tuple[str, ...]:
    """The forward's parameter names, read once per model class (not per request)."""
    import inspect

    return tuple(inspect.signature(model_class.forward).parameters)
