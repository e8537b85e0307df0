"""A request's media fields checked once, whichever surface carried them.

gRPC carries media items and `mm_processor_kwargs` as message fields; a JSON body carries the
items as `{"data": <base64>, "media_type": ...}` objects and the kwargs as an object or its JSON
text. The HTTP shell checks only what is JSON's own (an item's shape, its base64) and leaves the
rest to these rules, which `front.validation` applies to every request: an empty item, a
missing media type or kwargs that are not a JSON object read the same on every surface.
"""

from __future__ import annotations

from typing import Any

from proctor.server.common.errors import invalid
from proctor.server.engines.base import MediaItem
from proctor.server.front.bounded_json import loads_bounded


def media_item(field: str, index: int, data: bytes, media_type: str) -> MediaItem:
    """One item of `field` (images, videos, audios): its bytes given and its media type named."""
    if not data:
        raise invalid(f"{field}[{index}].data", "is empty")
    if not media_type:
        raise invalid(f"{field}[{index}].media_type", "is required (e.g. image/png)")
    return MediaItem(bytes(data), media_type)


def processor_kwargs(text: str) -> dict[str, Any]:
    """`mm_processor_kwargs` as the JSON text the wire carries → its object ({} when empty), read
    with the bounds of any body (`bounded_json`)."""
    if not text:
        return {}
    value = loads_bounded(text, field="mm_processor_kwargs")
    if not isinstance(value, dict):
        raise invalid("mm_processor_kwargs", "must be a JSON object")
    return value
