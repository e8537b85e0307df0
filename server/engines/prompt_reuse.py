"""Shared prefixes: which requests share one, and the bounded store of what was computed for one.

In GRPO-style distillation every prompt is rolled out n times and each finished sequence is
scored on its own, so a teacher sees the same prompt n times, often seconds apart, and with
verl's teacher loop or `/v1/completions` (TRL, the openai client) nobody says where the prompt
ends. So the server finds shared prefixes itself: two requests to the same teacher replica share
a prefix when their token ids agree from the start for at least `min_tokens`; `prompt_length`
plays no part in finding it (it only says which rows a request wants).

An engine keeps, per scored sequence, a *record* (the torch engine the sequence's KV cache and
rows, the vLLM engine the rows while vLLM's prefix cache holds the KV) in a `PrefixStore`: LRU,
with a time to live since last use and a cap on the bytes held, so a trainer that never repeats a
prefix costs a bounded amount of memory. A record is indexed by the chained hashes of its full
blocks of `block_tokens` tokens (hash k covers tokens 0..(k+1)B-1, as vLLM's prefix cache keys its
blocks): a lookup walks the request's own chain to the deepest block some record holds, then
compares the tokens (a hash collision never hands one sequence another's rows). A request's
`cache_salt` seeds its chain (as vLLM's first block hash): salts never find each other's records.

Reuse applies to a request when it is on (`inference.prompt_reuse`, default true), the request
is at least `inference.prompt_reuse_min_tokens` long (a shorter shared prefix is cheaper to
recompute than to look up and copy) and it carries no media (multimodal requests are always scored
whole).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from proctor.server.engines.base import EngineRequest
from proctor.server.engines.token_ids import TOKEN_DTYPE, token_array

# Setting names in a teacher's `inference` block (and `proctor serve --inference KEY=VALUE`).
ENABLED = "prompt_reuse"
MIN_TOKENS = "prompt_reuse_min_tokens"
MEMORY_MB = "prompt_reuse_memory_mb"
TTL_S = "prompt_reuse_ttl_s"
BLOCK_TOKENS = "prompt_reuse_block_tokens"


class ReuseSettingError(ValueError):
    """A prompt-reuse setting has a value that cannot work; the message names it."""


@dataclass(frozen=True)
class ReuseSettings:
    """When a request's prefix is looked up, and how much the store may hold."""

    enabled: bool = True
    min_tokens: int = 256
    memory_bytes: int = 2 << 30
    ttl_s: float = 300.0
    block_tokens: int = 16

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
        block = _number(inference, BLOCK_TOKENS, default.block_tokens, int, minimum=1)
        return cls(enabled=enabled, min_tokens=min_tokens, memory_bytes=int(memory_mb * (1 << 20)), ttl_s=ttl_s,
                   block_tokens=block)

    def applies(self, request: EngineRequest) -> bool:
        """Whether this request's prefix is looked up and its record kept."""
        return (
            self.enabled
            and self.memory_bytes > 0
            and request.num_tokens >= self.min_tokens
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


def block_hashes(token_ids: torch.Tensor | np.ndarray, block: int, salt: str = "") -> list[bytes]:
    """The chained 128-bit hashes of the full blocks of `block` tokens: hash k covers the salt and
    tokens 0..(k+1)*block-1 (the previous hash and block k), so equal hashes mean equal prefixes."""
    data = token_array(token_ids).tobytes()
    step = block * TOKEN_DTYPE.itemsize
    hashes: list[bytes] = []
    previous = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest() if salt else b""
    for start in range(0, len(data) - step + 1, step):
        previous = hashlib.blake2b(previous + data[start : start + step], digest_size=16).digest()
        hashes.append(previous)
    return hashes


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


V = TypeVar("V")
# Records a block hash leads to: the newest few, so that a prefix scored for other outputs (another
# top-k, temperature or score_ids) does not hide the record a request can copy from.
_PER_BLOCK = 4


@dataclass
class _Record(Generic[V]):
    tokens: np.ndarray
    hashes: list[bytes]
    value: V
    nbytes: int
    last_used: float


@dataclass(frozen=True)
class Match(Generic[V]):
    """A record whose first `shared` tokens equal the request's."""

    record_id: int
    value: V
    shared: int


@dataclass
class CacheStats:
    """What a store did (for tests and benchmarks; the server's metrics count per request)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # records larger than the whole cap, never stored


@dataclass
class PrefixStore(Generic[V]):
    """Records of scored sequences, found by their longest common prefix with a request (module
    docstring): an LRU bounded by bytes held, records expiring `ttl_s` after last use.

    Thread-safe (the torch engine uses it on a worker thread, tests inspect it from another).
    """

    memory_bytes: int
    ttl_s: float
    block_tokens: int = 16
    clock: Callable[[], float] = time.monotonic
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self._records: OrderedDict[int, _Record[V]] = OrderedDict()
        self._index: dict[bytes, list[int]] = {}  # block hash -> the newest records holding that prefix
        self._bytes = 0
        self._ids = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: ReuseSettings) -> PrefixStore[V]:
        return cls(settings.memory_bytes, settings.ttl_s, settings.block_tokens)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._records)

    def hashes(self, token_ids: torch.Tensor | np.ndarray, salt: str = "") -> list[bytes]:
        return block_hashes(token_ids, self.block_tokens, salt)

    def find(self, token_ids: torch.Tensor | np.ndarray, hashes: list[bytes] | None = None,
             *, at_least: int = 1) -> Match[V] | None:
        """The record sharing the longest prefix with these tokens (the most recent among equals),
        or None; a hit makes it the most recent."""
        found = self.candidates(token_ids, hashes, at_least=at_least)
        return found[0] if found else None

    def candidates(self, token_ids: torch.Tensor | np.ndarray, hashes: list[bytes] | None = None,
                   *, at_least: int = 1) -> list[Match[V]]:
        """The records holding the deepest block these tokens share with any (up to
        `_PER_BLOCK`, as they were asked for other outputs), each with the exact count of tokens
        shared (at least `at_least`), longest first, then most recent; hits become the most recent."""
        tokens = token_array(token_ids)
        hashes = self.hashes(tokens) if hashes is None else hashes
        now = self.clock()
        with self._lock:
            self._expire(now)
            for depth in range(len(hashes) - 1, -1, -1):
                ids = self._index.get(hashes[depth])
                if not ids:
                    continue
                found = []
                for record_id in reversed(ids):
                    record = self._records[record_id]
                    shared = common_prefix(record.tokens, tokens)
                    if shared >= at_least:
                        record.last_used = now
                        self._records.move_to_end(record_id)
                        found.append(Match(record_id, record.value, shared))
                if not found:
                    break
                self.stats.hits += 1
                return sorted(found, key=lambda match: -match.shared)
            self.stats.misses += 1
            return []

    def put(self, token_ids: torch.Tensor | np.ndarray, value: V, nbytes: int,
            hashes: list[bytes] | None = None) -> int | None:
        """Keep `value` for these tokens, evicting the least recently used to stay within the cap;
        its id, or None when it alone exceeds the cap (then it is not kept)."""
        tokens = token_array(token_ids).copy()
        hashes = self.hashes(tokens) if hashes is None else hashes
        nbytes = _held(tokens, hashes, nbytes)
        now = self.clock()
        with self._lock:
            if nbytes > self.memory_bytes:
                self.stats.refused += 1
                return None
            self._expire(now)
            while self._records and self._bytes + nbytes > self.memory_bytes:
                self._drop(next(iter(self._records)))
                self.stats.evictions += 1
            self._ids += 1
            self._records[self._ids] = _Record(tokens, hashes, value, nbytes, now)
            self._bytes += nbytes
            for digest in hashes:
                ids = self._index.setdefault(digest, [])
                ids.append(self._ids)
                del ids[:-_PER_BLOCK]
            return self._ids

    def resize(self, record_id: int, nbytes: int) -> None:
        """A kept record's value grew or shrank (its bytes are counted anew; it may be dropped)."""
        with self._lock:
            record = self._records.get(record_id)
            if record is None:
                return
            grown = _held(record.tokens, record.hashes, nbytes)
            self._bytes += grown - record.nbytes
            record.nbytes = grown
            while self._bytes > self.memory_bytes and self._records:
                self._drop(next(iter(self._records)))
                self.stats.evictions += 1

    def discard(self, record_id: int) -> None:
        with self._lock:
            self._drop(record_id)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._index.clear()
            self._bytes = 0

    def _drop(self, record_id: int) -> None:
        record = self._records.pop(record_id, None)
        if record is None:
            return
        self._bytes -= record.nbytes
        for digest in record.hashes:
            ids = self._index.get(digest)
            if ids and record_id in ids:
                ids.remove(record_id)
                if not ids:
                    del self._index[digest]

    def _expire(self, now: float) -> None:
        while self._records:
            oldest_id, oldest = next(iter(self._records.items()))
            if now - oldest.last_used < self.ttl_s:
                return
            self._drop(oldest_id)
            self.stats.evictions += 1


def _held(tokens: np.ndarray, hashes: list[bytes], nbytes: int) -> int:
    return int(nbytes) + tokens.nbytes + 40 * len(hashes)  # its value, its tokens, its index entries


# The front's affinity keeps every few block hashes of a request: enough to tell groups apart.
_AFFINITY_STRIDE = 4


class PromptAffinity:
    """The front's memory of which replica a prefix was last sent to, so that the members of a
    group go where their shared prefix is kept (each replica keeps its own records) unless that
    replica is busier than the least loaded one by more than a batch. Found as the engines find
    records (the deepest block hash it knows; a routing hint, so no tokens are compared).
    Bounded: `max_entries` hashes, LRU, the store's TTL."""

    def __init__(self, settings: ReuseSettings, *, max_entries: int = 1 << 18,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.max_entries = max_entries
        self.clock = clock
        self._where: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def key(self, request: EngineRequest) -> list[bytes] | None:
        """The request's prefix hashes the front keeps (at least `min_tokens` deep) when reuse
        applies to it, else None (no affinity)."""
        if not self.settings.applies(request):
            return None
        block = self.settings.block_tokens
        first = max(0, -(-self.settings.min_tokens // block) - 1)  # the block that reaches min_tokens
        hashes = block_hashes(request.token_ids, block, request.cache_salt)
        return hashes[first::_AFFINITY_STRIDE] or None

    def replica_of(self, hashes: list[bytes]) -> str | None:
        for digest in reversed(hashes):
            found = self._where.get(digest)
            if found is None:
                continue
            replica, at = found
            if self.clock() - at < self.settings.ttl_s:
                return replica
            del self._where[digest]
        return None

    def remember(self, hashes: list[bytes], replica: str) -> None:
        now = self.clock()
        for digest in hashes:
            self._where[digest] = (replica, now)
            self._where.move_to_end(digest)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)
