"""A scoring hook for any async rollout loop: score each sequence as soon as it finishes.

Rollouts finish one by one (or in small groups); waiting for the whole batch before asking
the teacher leaves the teacher idle during generation and the trainer idle during scoring.
`RolloutScorer` takes finished sequences (an async iterator, or one `submit` call each) and
hands back scored ones as their scores arrive, so scoring overlaps the rest of the rollout.

Routing: each sample names its teacher through a key column (verl's `data_source` by
default). A sample without that column, or with a value no teacher serves, raises
`RoutingError` before anything is sent: a sequence scored by the wrong teacher would train
silently on the wrong target.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proctor.client import TeacherClient, TeacherScores
from proctor.client.transports import MediaLike


class RoutingError(LookupError):
    """A sample cannot be routed: its key column is missing or names no teacher."""


@dataclass
class RolloutSample:
    """One finished rollout: prompt and response token ids, plus the row's other columns."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    meta: Mapping[str, Any] = field(default_factory=dict)
    images: Sequence[MediaLike] | None = None
    videos: Sequence[MediaLike] | None = None
    audios: Sequence[MediaLike] | None = None
    mm_processor_kwargs: Mapping[str, Any] | None = None
    # Ids to score per response row (e.g. the student's top-k, `proctor.client.batch.student_topk_ids`).
    score_ids: Any = None

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.response_ids]

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)


@dataclass
class ScoredSample:
    """A sample with its teacher scores; `index` is its position in the input order."""

    index: int
    sample: RolloutSample
    teacher_key: str | None
    scores: TeacherScores


async def _aiter(samples: AsyncIterable[RolloutSample] | Iterable[RolloutSample]) -> AsyncIterator[RolloutSample]:
    if isinstance(samples, AsyncIterable):
        async for sample in samples:
            yield sample
    else:
        for sample in samples:
            yield sample


class RolloutScorer:
    """Scores finished rollouts concurrently with the rollout that produces them.

    `key_column`: the sample column that selects the teacher (None: the server's only
    teacher). `teacher_map`: column value → teacher key sent to the server; when not given it
    is read from the server's catalogue (each teacher's name and routing keys).
    `response_rows_only`: score only rows from the prompt's end on (what trainers use; a long
    prompt then costs no bytes on the wire). `max_in_flight`: bound on sequences being
    scored (default: the client's concurrency).
    """

    def __init__(
        self,
        client: TeacherClient,
        *,
        key_column: str | None = "data_source",
        teacher_map: Mapping[str, str] | None = None,
        logprobs: bool = True,
        topk: int = 0,
        hidden_states: bool = False,
        hidden_form: str = "",
        response_rows_only: bool = True,
        max_in_flight: int | None = None,
    ) -> None:
        self.client = client
        self.key_column = key_column
        self.teacher_map = dict(teacher_map) if teacher_map is not None else None
        self.options = {"logprobs": logprobs, "topk": topk, "hidden_states": hidden_states, "hidden_form": hidden_form}
        self.response_rows_only = response_rows_only
        self.max_in_flight = max_in_flight or client.max_concurrency
        self._limit: asyncio.Semaphore | None = None
        self._submitted: list[asyncio.Task] = []
        self.scored_tokens = 0
        self.scored_sequences = 0

    async def resolve_routes(self) -> dict[str, str]:
        """The key → teacher map in use (fetched from the server once when not given)."""
        if self.teacher_map is None:
            self.teacher_map = await self.client.routing_table()
        return self.teacher_map

    def teacher_key_for(self, sample: RolloutSample, index: int | None = None) -> str | None:
        """The teacher key to send for a sample, or RoutingError (never a guess)."""
        if self.key_column is None:
            return None
        where = f"sample {index}" if index is not None else "sample"
        if self.key_column not in sample.meta:
            raise RoutingError(
                f"{where} has no {self.key_column!r} column to route by (columns: {sorted(sample.meta)}); "
                f"add it, or pass key_column=None when the server has one teacher"
            )
        value = sample.meta[self.key_column]
        value = value.item() if hasattr(value, "item") else value  # numpy / 0-d tensor cells
        if self.teacher_map is None:
            raise RoutingError("routes are not resolved yet: await resolve_routes() first")
        if value not in self.teacher_map:
            raise RoutingError(
                f"{where}: no teacher for {self.key_column}={value!r} (known: {sorted(self.teacher_map)})"
            )
        return self.teacher_map[value]

    async def score(self, sample: RolloutSample, index: int = 0) -> ScoredSample:
        """Score one sample now (routing checked first)."""
        await self.resolve_routes()
        key = self.teacher_key_for(sample, index)
        return await self._score(index, sample, key)

    async def _score(self, index: int, sample: RolloutSample, key: str | None) -> ScoredSample:
        scores = await self.client.score(
            sample.token_ids,
            teacher_key=key,
            prompt_length=sample.prompt_length if self.response_rows_only and sample.prompt_length > 0 else None,
            images=sample.images, videos=sample.videos, audios=sample.audios,
            mm_processor_kwargs=sample.mm_processor_kwargs,
            **({"score_ids": sample.score_ids} if sample.score_ids is not None else {}),
            **self.options,
        )
        self.scored_tokens += scores.num_tokens
        self.scored_sequences += 1
        return ScoredSample(index, sample, key, scores)

    def _semaphore(self) -> asyncio.Semaphore:
        if self._limit is None:
            self._limit = asyncio.Semaphore(self.max_in_flight)
        return self._limit

    async def scored(
        self, samples: AsyncIterable[RolloutSample] | Iterable[RolloutSample]
    ) -> AsyncIterator[ScoredSample]:
        """Yield each sample's scores as soon as they arrive (completion order; see `index`).

        Samples are taken from `samples` while earlier ones are being scored. The first
        error (routing or scoring) stops the iteration and cancels the scoring in flight.
        """
        await self.resolve_routes()
        limit = self._semaphore()
        finished: asyncio.Queue[asyncio.Task] = asyncio.Queue()
        pending: set[asyncio.Task] = set()

        def settle(task: asyncio.Task) -> None:
            limit.release()
            pending.discard(task)
            finished.put_nowait(task)

        async def produce() -> None:
            index = 0
            async for sample in _aiter(samples):
                key = self.teacher_key_for(sample, index)
                await limit.acquire()
                task = asyncio.ensure_future(self._score(index, sample, key))
                pending.add(task)
                task.add_done_callback(settle)
                index += 1

        producer = asyncio.ensure_future(produce())
        producer.add_done_callback(finished.put_nowait)
        producing = True
        try:
            while producing or pending or not finished.empty():
                task = await finished.get()
                if task is producer:
                    producing = False
                    task.result()  # a routing error or a failing sample iterator surfaces here
                    continue
                yield task.result()
        finally:
            producer.cancel()
            for task in list(pending):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.gather(producer, *pending, return_exceptions=True)

    # -- callback style ----------------------------------------------------------------------
    def submit(self, sample: RolloutSample) -> asyncio.Task:
        """Start scoring one finished sample (call it from the rollout loop's completion hook).

        Routing is checked now: a bad key raises here, at the sample that caused it. Routes
        must be resolved first (`await scorer.resolve_routes()`)."""
        index = len(self._submitted)
        key = self.teacher_key_for(sample, index)
        task = asyncio.ensure_future(self._limited(index, sample, key))
        self._submitted.append(task)
        return task

    async def _limited(self, index: int, sample: RolloutSample, key: str | None) -> ScoredSample:
        async with self._semaphore():
            return await self._score(index, sample, key)

    async def gather(self) -> list[ScoredSample]:
        """Wait for everything submitted; results in submission order. Resets the hook."""
        tasks, self._submitted = self._submitted, []
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
