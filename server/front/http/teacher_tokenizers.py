"""Each teacher's tokenizer in the front process, for vLLM's surface: text prompts become token
ids with it, and every answered id's `decoded_token` is its text.

Loaded once per teacher from its model directory (a thread does the first load: reading a
tokenizer holds the loop for a while), and kept with that teacher's `decoded_token` table, which
grows with the ids answered (at most the vocabulary). A teacher without a readable tokenizer
decodes to "" and refuses text prompts.

Where it is read from is the teacher's own `tokenizer_path`, set from the serving plan (the
teacher's model directory), whatever its replicas run (a weight-swapped teacher included).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

from proctor.server.alignment.students import load_tokenizer
from proctor.server.front.fleet.routing import ReplicaSet
from proctor.server.front.token_text import TokenText

log = logging.getLogger(__name__)


def model_dir(teacher_set: ReplicaSet) -> Path | None:
    """Where the teacher's tokenizer lives (None: the plan gave it none)."""
    return Path(teacher_set.tokenizer_path) if teacher_set.tokenizer_path else None


def _load(path: Path | None) -> Any:
    if path is None or not path.is_dir():
        return None
    try:
        return load_tokenizer(path)
    except Exception as exc:  # no tokenizer files, or one transformers cannot read
        log.info("no tokenizer for %s (%s): decoded_token will be empty, text prompts refused", path, exc)
        return None


class Tokenizers:
    """Every teacher's tokenizer and `decoded_token` table, each made on first use."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}
        self._texts: dict[str, TokenText] = {}
        self._lock = threading.Lock()

    def _get(self, teacher_set: ReplicaSet) -> Any:
        with self._lock:
            if teacher_set.name not in self._loaded:
                self._loaded[teacher_set.name] = _load(model_dir(teacher_set))
            return self._loaded[teacher_set.name]

    async def tokenizer(self, teacher_set: ReplicaSet) -> Any:
        """The teacher's tokenizer or None; its first load runs in a worker thread."""
        if teacher_set.name in self._loaded:
            return self._loaded[teacher_set.name]
        return await asyncio.to_thread(self._get, teacher_set)

    def token_text(self, teacher_set: ReplicaSet, tokenizer: Any) -> TokenText:
        """The teacher's `decoded_token` table: each id's text as vLLM reports it ("" without a
        tokenizer)."""
        text = self._texts.get(teacher_set.name)
        if text is None:
            text = self._texts[teacher_set.name] = TokenText(tokenizer)
        return text
