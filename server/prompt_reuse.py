"""Shared-prompt reuse: which requests share a prompt, and the bounded cache that remembers one.

In GRPO-style distillation every prompt is rolled out n times and each finished sequence is
scored on its own, so a teacher sees the same `token_ids[:prompt_length]` n times, often seconds
apart. Requests *share a prompt* when they go to the same teacher (the cache is per engine, so
per teacher replica) with equal `token_ids[:first_row]`; nothing on the wire changes. An engine
keeps what it computed for a prompt (the torch engine its KV cache, the vLLM engine a record of
what vLLM's prefix cache holds and the first response row) in a `PromptCache`: LRU, with a time to
live since last use and a cap on the bytes held, so a trainer that never repeats a prompt costs
a bounded amount of memory and nothing else.

Reuse applies to a request when it is on (`inference.prompt_reuse`, default true), its prompt is
at least `inference.prompt_reuse_min_tokens` long (shorter prompts are cheaper to recompute than
to look up and copy) and it carries no media (multimodal requests are always scored whole).
`prompt_key` hashes the prompt; an entry also keeps the prompt itself and a hit compares it, so
a hash collision can never hand one prompt another's cache.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from proctor.server.engines.base import EngineRequest

# Setting names in a teacher's `inference` block (and `proctor serve --inference KEY=VALUE`).
ENABLED = "prompt_reuse"
MIN_TOKENS = "prompt_reuse_min_tokens"
MEMORY_MB = "prompt_reuse_memory_mb"
TTL_S = "prompt_reuse_ttl_s"
SETTING_NAMES = (ENABLED, MIN_TOKENS, MEMORY_MB, TTL_S)


class ReuseSettingError(ValueError):
    """A prompt-reuse setting has a value that cannot work; the message names it."""


@dataclass(frozen=True)
class ReuseSettings:
    """When a request's prompt is looked up, and how much the cache may hold."""

    enabled: bool = True
    min_tokens: int = 256
    memory_bytes: int = 2 << 30
    ttl_s: float = 300.0

    @classmethod
    def from_inference(cls, inference: Mapping[str, Any] | None) -> ReuseSettings:
        """The settings of a teacher's `inference` block (absent keys take the defaults)."""
        inference = inference or {}
        default = cls()
        enabled = inference.get(ENABLED, default.enabled)
        if isinstance(enabled, str):
            enabled = {"true": True, "false": False}.get(enabled.lower(), enabled)
        if not isinstance(enabled, bool):
            raise ReuseSettingError(f"inference.{ENABLED} must be true or false, got {enabled!r}")
        min_tokens = _number(inference, MIN_TOKENS, default.min_tokens, int, minimum=1)
        memory_mb = _number(inference, MEMORY_MB, default.memory_bytes / (1 << 20), float, minimum=0)
        ttl_s = _number(inference, TTL_S, default.ttl_s, float, minimum=0)
        return cls(enabled=enabled, min_tokens=min_tokens, memory_bytes=int(memory_mb * (1 << 20)), ttl_s=ttl_s)

    def applies(self, request: EngineRequest) -> bool:
        """Whether this request's prompt is looked up and kept."""
        return (
            self.enabled
            and self.memory_bytes > 0
            and request.first_row >= self.min_tokens
            and not request.media
        )


def _number(inference: Mapping[str, Any], name: str, default: float, kind: type, *, minimum: float):
    value = inference.get(name, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ReuseSettingError(f"inference.{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or number < minimum:
        raise ReuseSettingError(f"inference.{name} must be a number >= {minimum}, got {value!r}")
    return number


def prompt_key(request: EngineRequest) -> bytes:
    """A 128-bit hash of the request's prompt, `token_ids[:first_row]` (its length included)."""
    prompt = request.token_ids[: request.first_row]
    digest = hashlib.blake2b(prompt.numpy().tobytes(), digest_size=16)
    digest.update(request.first_row.to_bytes(8, "little"))
    return digest.digest()


V = TypeVar("V")


@dataclass
class _Entry(Generic[V]):
    prompt: torch.Tensor
    value: V
    nbytes: int
    last_used: float


@dataclass
class CacheStats:
    """What a cache did (for tests and benchmarks; the server's metrics count per request)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # entries larger than the whole cap, never stored


@dataclass
class PromptCache(Generic[V]):
    """An LRU map prompt -> value, bounded by bytes held, entries expiring `ttl_s` after last use.

    Thread-safe (the torch engine uses it on a worker thread, tests inspect it from another).
    """

    memory_bytes: int
    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self._entries: OrderedDict[bytes, _Entry[V]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, prompt: torch.Tensor) -> V | None:
        """The value kept for this prompt, or None (absent, expired, or a different prompt)."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            entry = self._entries.get(key)
            if entry is None or not torch.equal(entry.prompt, prompt):
                self.stats.misses += 1
                return None
            entry.last_used = now
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry.value

    def put(self, key: bytes, prompt: torch.Tensor, value: V, nbytes: int) -> bool:
        """Keep `value` (replacing any entry of that key), evicting the least recently used to
        stay within the cap; False when it alone exceeds the cap (then it is not kept)."""
        nbytes = int(nbytes) + prompt.numel() * prompt.element_size()
        now = self.clock()
        with self._lock:
            self._drop(key)
            if nbytes > self.memory_bytes:
                self.stats.refused += 1
                return False
            self._expire(now)
            while self._entries and self._bytes + nbytes > self.memory_bytes:
                oldest = next(iter(self._entries))
                self._drop(oldest)
                self.stats.evictions += 1
            self._entries[key] = _Entry(prompt.clone(), value, nbytes, now)
            self._bytes += nbytes
            return True

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def _expire(self, now: float) -> None:
        while self._entries:
            oldest_key, oldest = next(iter(self._entries.items()))
            if now - oldest.last_used < self.ttl_s:
                return
            self._drop(oldest_key)
            self.stats.evictions += 1


class PromptAffinity:
    """The front's memory of which replica a prompt was last sent to, so that the members of a group
    go where its prompt is kept (each replica keeps its own cache) unless that replica is busier
    than the least loaded one by more than a batch. Bounded: `max_entries` LRU, the cache's TTL."""

    def __init__(self, settings: ReuseSettings, *, max_entries: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.max_entries = max_entries
        self.clock = clock
        self._where: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def key(self, request: EngineRequest) -> bytes | None:
        """The request's prompt key when reuse applies to it, else None (no affinity)."""
        return prompt_key(request) if self.settings.applies(request) else None

    def replica_of(self, key: bytes) -> str | None:
        found = self._where.get(key)
        if found is None:
            return None
        replica, at = found
        if self.clock() - at >= self.settings.ttl_s:
            del self._where[key]
            return None
        return replica

    def remember(self, key: bytes, replica: str) -> None:
        self._where[key] = (replica, self.clock())
        self._where.move_to_end(key)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)
