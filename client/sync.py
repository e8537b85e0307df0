"""A blocking facade over `TeacherClient` for scripts and notebooks.

The async client lives on a private event loop in a daemon thread, so blocking calls work
from any thread, including code that already runs inside another event loop (a notebook),
where `asyncio.run` would refuse.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from proctor.client.aligned import AlignedScores
from proctor.client.client import ScoreInput, TeacherClient, TeacherInfo, TeacherScores


class SyncTeacherClient:
    """Blocking `score`, `score_many`, `teachers`, `unembedding`; use as a context manager."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="proctor-client", daemon=True)
        self._thread.start()
        self.client = TeacherClient(target, **kwargs)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def score(self, token_ids: Sequence[int] | torch.Tensor, **kwargs: Any) -> TeacherScores | AlignedScores:
        return self._run(self.client.score(token_ids, **kwargs))

    def score_many(self, sequences: Iterable[Sequence[int] | torch.Tensor | ScoreInput], **kwargs: Any):
        return self._run(self.client.score_many(list(sequences), **kwargs))

    def stream_hidden_states(self, token_ids: Sequence[int] | torch.Tensor, **kwargs: Any) -> TeacherScores:
        return self._run(self.client.stream_hidden_states(token_ids, **kwargs))

    def teachers(self, **kwargs: Any) -> dict[str, TeacherInfo]:
        return self._run(self.client.teachers(**kwargs))

    def unembedding(self, teacher_key: str | None = None, **kwargs: Any) -> torch.Tensor:
        return self._run(self.client.unembedding(teacher_key, **kwargs))

    def close(self) -> None:
        if self._thread.is_alive():
            self._run(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> SyncTeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
