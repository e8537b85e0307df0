"""Media placeholders in a rollout's token ids: one rule for every multimodal engine.

A multimodal rollout sends its prompt as the token ids its processor produced: each image,
video or audio clip is a *run* of its modality's placeholder token (`<|image_pad|>` ×N for
Qwen2-VL, `<|IMAGE|>`/`<|VIDEO|>`/`<|AUDIO|>` for the Qwen Omni Thinkers), N set by the item's
size. A score is only right when those runs match the media the request carries, item by item:
the same number of runs per modality, in order, each of the length the model's processor makes
for that item. Otherwise the teacher would score a sequence whose media embeddings land on
other positions than the rollout's, a silently wrong answer; it is INVALID_ARGUMENT instead.

Engines get the expected run lengths from the model's own processor (the torch engine: the
processor's expansion of one placeholder per item; vLLM: its renderer's expansion of the
collapsed prompt) and hand both sides to `check_runs`. `collapse_runs` makes the prompt that
vLLM expects for token input (one placeholder per item, which vLLM's processor expands again).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from proctor.server.engines.base import EngineRequest, RequestRejected

# The request's media fields, and the modality names of vLLM's `multi_modal_data`.
FIELDS = ("images", "videos", "audios")
_TOKEN_KEYS = {
    "images": ("image_token_id", "image_token_index"),
    "videos": ("video_token_id", "video_token_index"),
    "audios": ("audio_token_id", "audio_token_index"),
}
_TOWERS = {"images": "vision_config", "videos": "vision_config", "audios": "audio_config"}


@dataclass(frozen=True)
class Placeholders:
    """Each served modality's placeholder token id (a model directory's config says which)."""

    token_ids: dict[str, int]
    # The audio feature extractor's sample rate: clips must come at it (see `check_counts`).
    audio_rate: int | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(kind for kind in FIELDS if kind in self.token_ids)

    @classmethod
    def of_model(cls, model_path: str | Path) -> Placeholders:
        """Read from config.json (the Omni models keep theirs under `thinker_config`); an empty
        map for a text-only model, whose engines then refuse media."""
        path = Path(model_path) / "config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        config = config.get("thinker_config", config)
        found: dict[str, int] = {}
        for kind, keys in _TOKEN_KEYS.items():
            if config.get(_TOWERS[kind]) is None:
                continue
            for key in keys:
                if isinstance(config.get(key), int):
                    found[kind] = int(config[key])
                    break
        return cls(found, _audio_rate(Path(model_path)) if "audios" in found else None)


def _audio_rate(root: Path) -> int | None:
    """The feature extractor's sampling_rate, from processor_config.json (transformers 5) or
    preprocessor_config.json (the released checkpoints)."""
    for name, section in (("processor_config.json", "feature_extractor"), ("preprocessor_config.json", None)):
        path = root / name
        if path.exists():
            config = json.loads(path.read_text())
            config = config.get(section, {}) if section else config
            if isinstance(config.get("sampling_rate"), int):
                return int(config["sampling_rate"])
    return None


def runs(ids: np.ndarray, token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of token_id in ids, in order (whole-array work)."""
    hit = np.concatenate(([False], ids == token_id, [False]))
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(start), int(end - start)) for start, end in zip(edges[::2], edges[1::2], strict=True)]


def _item_counts(request: EngineRequest) -> dict[str, int]:
    media = request.media
    return {kind: len(getattr(media, kind)) if media else 0 for kind in FIELDS}


def check_counts(request: EngineRequest, placeholders: Placeholders) -> RequestRejected | None:
    """The cheap half of the rule, before any processing: media of kinds the model serves,
    one placeholder run per item of each kind, and no placeholder of a kind the request carries
    none of (a text request to a multimodal teacher included)."""
    ids = request.token_ids
    for kind, count in _item_counts(request).items():
        if count and kind not in placeholders.token_ids:
            served = ", ".join(placeholders.kinds) or "no media"
            return RequestRejected(f"{kind}[0]", f"this teacher takes {served}, not {kind}")
        if kind not in placeholders.token_ids:
            continue
        found = len(runs(ids, placeholders.token_ids[kind]))
        if found and not count:  # a lost item: scored as text, every row after it would be misaligned
            position = int(np.flatnonzero(ids == placeholders.token_ids[kind])[0])
            return RequestRejected(
                kind, f"token {position} is the model's {kind} placeholder, but the request carries no {kind}: "
                f"attach the {kind} the rollout's processor expanded there",
            )
        if found != count:
            return RequestRejected(
                "token_ids", f"{found} {kind} placeholder run(s) for {count} {kind}: send the prompt's "
                "token ids as the rollout's processor expanded them, one run per item",
            )
    return _check_audio_rates(request, placeholders)


def _check_audio_rates(request: EngineRequest, placeholders: Placeholders) -> RequestRejected | None:
    """Clips at the feature extractor's own rate only. The rollout's processor took them at that
    rate (transformers' feature extractors refuse any other), so a clip at another rate is not
    what the rollout saw, and resampling it here would score other features than it generated
    from (vLLM would resample with its own filter, the torch engine's processor would refuse)."""
    if placeholders.audio_rate is None or not (request.media and request.media.audios):
        return None
    for index, (_, rate) in enumerate(decoded_media(request).get("audio", [])):
        if int(rate) != placeholders.audio_rate:
            return RequestRejected(
                f"audios[{index}]", f"a {rate} Hz clip; this teacher's feature extractor takes "
                f"{placeholders.audio_rate} Hz audio: send it resampled as the rollout's processor took it",
            )
    return None


def check_runs(request: EngineRequest, placeholders: Placeholders, expected: dict[str, list[int]]) -> RequestRejected | None:
    """Each placeholder run's length against what the processor makes for its item."""
    ids = request.token_ids
    for kind, lengths in expected.items():
        found = runs(ids, placeholders.token_ids[kind])
        for index, ((start, length), want) in enumerate(zip(found, lengths, strict=False)):
            if length != want:
                return RequestRejected(
                    f"{kind}[{index}]", f"its placeholder run at token {start} has {length} tokens; the "
                    f"model's processor makes {want} for this item (resized differently, or other "
                    "processor settings than the rollout's?)",
                )
        if len(found) != len(lengths):
            return RequestRejected("token_ids", f"{len(found)} {kind} placeholder runs for {len(lengths)} {kind}")
    return None


def collapse_runs(ids: np.ndarray, placeholders: Placeholders) -> list[int]:
    """The ids with each placeholder run cut to one token (what vLLM expands for token input)."""
    keep = np.ones(ids.shape[0], dtype=bool)
    for token_id in placeholders.token_ids.values():
        same = ids == token_id
        keep[1:] &= ~(same[1:] & same[:-1])
    return ids[keep].tolist()


def run_lengths(ids: list[int] | np.ndarray, placeholders: Placeholders, kinds: list[str]) -> dict[str, list[int]]:
    """Each modality's run lengths in an expanded prompt (the processor's answer)."""
    array = np.asarray(ids, dtype=np.int64)
    return {kind: [length for _, length in runs(array, placeholders.token_ids[kind])] for kind in kinds}


def decoded_media(request: EngineRequest) -> dict[str, list[Any]]:
    """vLLM's `multi_modal_data` as the service decoded it (`media.decode_media`)."""
    media = request.media
    if media is None:
        return {}
    if media.decoded is not None:
        return media.decoded
    from proctor.server.engines.media import multi_modal_data

    return multi_modal_data(media)

