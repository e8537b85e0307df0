"""Retries with exponential backoff and full jitter, bounded by the call's deadline.

Only UNAVAILABLE and RESOURCE_EXHAUSTED (a full queue) are retried: they say "same request,
later". Any other code is the caller's to see at once (a bad request stays bad), and so is a
request too large for a message (HTTP 413, or gRPC's RESOURCE_EXHAUSTED "message larger than
max"): the transports report it as PAYLOAD_TOO_LARGE, since it can never fit as sent. When the server sends a
retry hint, the client waits at least that long (plus jitter, so that many trainers pushed
back together do not return together). Scoring is idempotent, so a retried request that the
server had in fact finished costs compute but never duplicates a result.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from proctor.client.transports import TeacherError, make_error

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """max_attempts counts the first try; delays grow initial_backoff_s · multiplier^n."""

    max_attempts: int = 10
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    max_hint_s: float = 30.0

    def delay(self, attempt: int, hint: float | None, rng: random.Random) -> float:
        """Seconds to wait before retry number `attempt` (1-based)."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        jittered = rng.uniform(0.0, ceiling)  # "full jitter"
        if hint is None:
            return jittered
        hint = min(hint, self.max_hint_s)
        return hint + rng.uniform(0.0, min(ceiling, max(hint, 0.01)) * 0.5)


NO_RETRY = RetryPolicy(max_attempts=1)


class Deadline:
    """An absolute deadline on the monotonic clock; None means no limit."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        if self._at is None:
            return None
        return self._at - time.monotonic()

    def expired_error(self) -> TeacherError:
        return make_error("DEADLINE_EXCEEDED", f"deadline of {self.timeout:.3f}s passed")


async def call_with_retries(
    attempt: Callable[[float | None], Awaitable[T]],
    *,
    policy: RetryPolicy,
    deadline: Deadline,
    rng: random.Random | None = None,
    on_retry: Callable[[TeacherError, float], None] | None = None,
) -> T:
    """Run attempt(remaining_seconds) until it succeeds, fails for good, or time runs out."""
    rng = rng or random.Random()
    tries = 0
    while True:
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise deadline.expired_error()
        tries += 1
        try:
            return await attempt(remaining)
        except TeacherError as error:
            if not error.retryable or tries >= policy.max_attempts:
                raise
            wait = policy.delay(tries, error.retry_after, rng)
            left = deadline.remaining()
            if left is not None and wait >= left:
                raise  # waiting would outlive the deadline: report the real cause now
            if on_retry is not None:
                on_retry(error, wait)
            await asyncio.sleep(wait)
