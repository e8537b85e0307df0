"""SGLang's `sampling_params` and `image_data` as `/generate`'s scoring subset reads them.

A prompt's sampling_params are checked whole (every key SGLang knows, `max_new_tokens` 0 or 1,
`n` 1); with `max_new_tokens` 1 the answer is the greedy token, so what would sample another
(a temperature without `top_k` 1, stop strings, penalties, grammars) is refused, each naming its
key. Images come as SGLang's clients send them, inline: base64 or a `data:<type>;base64,` URL
(slime's `encode_image_for_rollout_engine`), never a URL or a path to fetch.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from proctor.proto import scoring_pb2
from proctor.server.common.errors import invalid
from proctor.server.front.ids import int32_ids

NOT_SCORING = "is not supported: this server scores prompts (max_new_tokens 0, or 1 greedy token)"
# SGLang's default when sampling_params leaves it out: a generation this server does not do.
_SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
                (b"BM", "image/bmp"))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- sampling_params ------------------------------------------------------------------------
# Neutral values of the parameters that would change a greedy token (max_new_tokens 1).
_GREEDY_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stop": (None, "", []), "min_new_tokens": (None, 0), "repetition_penalty": (None, 1, 1.0),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "regex": (None,), "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,),
    "custom_params": (None, {}), "min_p": (None, 0, 0.0),
}
_IGNORED = {"top_p", "top_k", "sampling_seed", "stream_interval", "thinking_budget", "max_thinking_tokens"}
_FLAGS = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "ignore_eos")
_KNOWN = {"max_new_tokens", "temperature", "n", "stop_token_ids", *_FLAGS, *_GREEDY_NEUTRAL, *_IGNORED}


@dataclass(frozen=True)
class Sampling:
    """One prompt's sampling_params as far as scoring reads them."""

    max_new_tokens: int
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


def _greedy(params: dict[str, Any], field: str) -> None:
    """max_new_tokens 1 answers the greedy token: sampling that could pick another is refused."""
    temperature, top_k = params.get("temperature", 1.0), params.get("top_k")
    if not (temperature == 0 or top_k == 1):
        raise invalid(f"{field}.temperature", f"is {temperature!r}; with max_new_tokens 1 this server answers the "
                      "greedy token only: send temperature 0 (or top_k 1)")
    for key, neutral in _GREEDY_NEUTRAL.items():
        if params.get(key) not in neutral:
            raise invalid(f"{field}.{key}", f"is {params[key]!r}; with max_new_tokens 1 only its neutral value "
                          "is served (the greedy token)")


def sampling(params: Any, field: str) -> Sampling:
    """One prompt's sampling_params checked: every key known, max_new_tokens 0 or 1, n 1."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise invalid(field, "must be an object")
    for key in params:
        if key not in _KNOWN:
            raise invalid(f"{field}.{key}", NOT_SCORING)
    max_new = params.get("max_new_tokens", _SGLANG_DEFAULT_MAX_NEW_TOKENS)
    if not is_int(max_new) or max_new not in (0, 1):
        raise invalid(f"{field}.max_new_tokens", f"is {max_new!r}{' (SGLang default)' if 'max_new_tokens' not in params else ''}; "
                      "this server scores prompts: send 0 (or 1 for the greedy next token)")
    if params.get("n", 1) != 1:
        raise invalid(f"{field}.n", f"is {params['n']!r}; only 1 is served here")
    temperature = params.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not temperature >= 0):
        raise invalid(f"{field}.temperature", "must be a number >= 0")
    if max_new == 1:
        _greedy(params, field)
    flags = {}
    for key in _FLAGS:
        if params.get(key) is not None:
            if not isinstance(params[key], bool):
                raise invalid(f"{field}.{key}", "must be a boolean")
            flags[key] = params[key]
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise invalid(f"{field}.stop_token_ids", "must be a list of token ids")
    int32_ids(f"{field}.stop_token_ids", stop_ids)
    return Sampling(max_new, stop_token_ids=tuple(stop_ids), **flags)



def _image(value: Any, field: str) -> scoring_pb2.Media:
    """One image as SGLang's clients send it: a base64 string, or a `data:<type>;base64,` URL."""
    if not isinstance(value, str) or not value:
        raise invalid(field, "must be an image as base64 or a data: URL")
    media_type = ""
    if value.startswith("data:"):
        head, _, value = value.partition(",")
        if not head.endswith(";base64"):
            raise invalid(field, "a data: URL must be base64 (data:image/png;base64,...)")
        media_type = head[len("data:"):-len(";base64")]
    elif value.startswith(("http://", "https://", "file:", "/")):
        raise invalid(field, "is a URL or a path; this server takes images inline only (base64 or a data: URL)")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(field, "is not valid base64") from None
    if not media_type:
        media_type = next((kind for magic, kind in _IMAGE_MAGIC if data.startswith(magic)),
                          "image/webp" if data[8:12] == b"WEBP" else "image/png")
    return scoring_pb2.Media(data=data, media_type=media_type)


def images(image_data: Any, count: int, batch: bool) -> list[list[scoring_pb2.Media]]:
    """image_data per prompt: for one prompt an image or a list of them; for a batch one entry
    per prompt (an image, a list of images, or null)."""
    if image_data is None or image_data == []:
        return [[] for _ in range(count)]
    if not batch:
        items = image_data if isinstance(image_data, list) else [image_data]
        return [[_image(item, f"image_data[{index}]") for index, item in enumerate(items)]]
    if not isinstance(image_data, list) or len(image_data) != count:
        raise invalid("image_data", f"must have one entry per prompt ({count})")
    out = []
    for index, entry in enumerate(image_data):
        items = [] if entry is None else entry if isinstance(entry, list) else [entry]
        out.append([_image(item, f"image_data[{index}][{sub}]") for sub, item in enumerate(items)])
    return out
