"""Building and loading transformers models, one at a time in this process.

transformers 5 turns weight tying and initialisation off for the length of a load by swapping
class attributes (`initialization.no_tie_weights` / `no_init_weights`: keep the attribute, set
a no-op, put the kept one back). Two loads in two threads interleave those keeps and restores,
and the process is left with `PreTrainedModel.tie_weights` a no-op for good: every tied model
built after that has an untied, randomly initialised head, and scores come out silently wrong.
A server loads in worker threads (an engine start, a restart while the other replicas serve,
the test suite's references beside them), so every model proctor builds goes through `build`:
one lock, and a check that the class attributes are transformers' own first (fail closed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_LOCK = threading.Lock()
# The methods transformers swaps during a load, by the qualified name of the real one.
_GUARDED = {"tie_weights": "PreTrainedModel.tie_weights", "init_weights": "PreTrainedModel.init_weights"}


class TransformersStateCorrupted(RuntimeError):
    """transformers' model class was left patched by a load this lock did not cover."""


def check_intact() -> None:
    """Refuse to build on a transformers whose load-time patches were left in place."""
    from transformers import PreTrainedModel

    for name, qualname in _GUARDED.items():
        current = getattr(PreTrainedModel, name)
        if getattr(current, "__qualname__", "") != qualname:
            raise TransformersStateCorrupted(
                f"transformers' PreTrainedModel.{name} is {getattr(current, '__qualname__', current)!r}, not its own: "
                "a model was loaded in another thread outside proctor's loading lock, and models built now "
                "would be wrong (untied or uninitialised weights); restart the process")


def build(make: Callable[..., T], *args, **kwargs) -> T:
    """`make(*args, **kwargs)` (a `from_pretrained`, `from_config` or model class) under the
    process's one loading lock, after checking transformers is intact."""
    with _LOCK:
        check_intact()
        return make(*args, **kwargs)
