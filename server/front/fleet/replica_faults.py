"""When a failed request says something about its replica, and when it says it about itself.

The rule (one place; `routing.ReplicaSet.score` applies it):
- A request that fails on a replica (a server fault of that request alone, `RequestFailed`, or
  a replica error) is retried on another replica at most once (`RETRIES_AFTER_FAULT`). Failing
  there too, it is a *poison request*: it fails with INTERNAL naming both causes, is counted
  (`proctor:poison_requests_total`), and is never tried on a third replica, so one request
  cannot take a teacher's replicas down one by one.
- A `RequestFailed` alone never takes its replica out of rotation. What does: the replica's
  health probe failing (run after each such fault), or several *different* requests failing on
  it that another replica then answered (`StrikeRecord`): the request was fine, the replica was
  not. A request that fails everywhere is evidence against itself, not against any replica.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

# Retries a request gets on another replica after it failed on one.
RETRIES_AFTER_FAULT = 1
# Distinct requests that failed on a replica and were answered elsewhere, within the window,
# that take the replica out of rotation.
STRIKES_TO_FAIL = 2
STRIKE_WINDOW_S = 60.0


@dataclass
class StrikeRecord:
    """The requests that failed on one replica and were answered by another, recently."""

    needed: int = STRIKES_TO_FAIL
    window_s: float = STRIKE_WINDOW_S
    _strikes: collections.OrderedDict[str, float] = field(default_factory=collections.OrderedDict)

    def add(self, request_key: str, now: float | None = None) -> bool:
        """Record one; whether the replica is now unwell (`needed` distinct requests in the window)."""
        now = time.monotonic() if now is None else now
        self._strikes[request_key] = now
        self._strikes.move_to_end(request_key)
        while self._strikes and next(iter(self._strikes.values())) < now - self.window_s:
            self._strikes.popitem(last=False)
        return len(self._strikes) >= self.needed

    def clear(self) -> None:
        self._strikes.clear()

    def __len__(self) -> int:
        return len(self._strikes)
