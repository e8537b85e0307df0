"""Scoring a batch so that one request can fail only itself.

Why: an engine that raises on a batch (a media tensor its forward refuses, an out-of-memory for
the batch's size, a bug that one odd input reaches) says nothing about which request is at
fault. Failing the whole batch would fail its innocent batch-mates; calling it a replica error
would restart the replica and move the same request on to the next one, which it takes down
too. So a batch that raises is split in halves, each scored again on the same replica (one half
after the other: an out-of-memory batch must not be retried at its full size at once), until
the request at fault stands alone: it gets a `RequestFailed` naming the cause, every other
request its result. A batch that ran out of memory is retried the same way, so its requests are
answered in smaller batches and only a request that does not fit alone fails.

`EngineError` (the replica itself is unwell: its process died) is not split: the requests of
that part get it as their outcome, and those already answered keep their results. A request
whose caller gave up while its batch was being split is not scored again (`RequestAborted`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proctor.server.engines.base import (
    EngineError,
    EngineRequest,
    Outcome,
    RequestAborted,
    RequestFailed,
    TeacherEngine,
)
from proctor.server.engines.faults import describe_fault, is_out_of_memory

log = logging.getLogger(__name__)


async def score_isolating(
    engine: TeacherEngine, requests: list[EngineRequest], wanted: Callable[[EngineRequest], bool]
) -> list[Outcome]:
    """One outcome per request, in order; `wanted(request)` is False once its caller gave up.

    Raises only what `engine.score` raises for the first, whole batch when that is an
    `EngineError` (the batcher's caller then treats the replica as failed)."""
    try:
        return _checked(requests, await engine.score(requests))
    except EngineError:
        raise
    except Exception as exc:
        return await _split(engine, requests, exc, wanted)


async def _score_part(
    engine: TeacherEngine, requests: list[EngineRequest], wanted: Callable[[EngineRequest], bool]
) -> list[Outcome]:
    """A part of a failed batch: its callers still waiting are scored, the rest aborted."""
    live = [r for r in requests if wanted(r)]
    outcomes: dict[str, Outcome] = {}
    if live:
        try:
            scored = _checked(live, await engine.score(live))
        except EngineError as exc:  # the replica went: this part's requests hear it
            scored = [exc] * len(live)
        except Exception as exc:
            scored = await _split(engine, live, exc, wanted)
        outcomes = {r.key: o for r, o in zip(live, scored, strict=True)}
    return [outcomes.get(r.key) or RequestAborted(f"request {r.request_id!r} was withdrawn") for r in requests]


async def _split(
    engine: TeacherEngine, requests: list[EngineRequest], exc: Exception, wanted: Callable[[EngineRequest], bool]
) -> list[Outcome]:
    cause, out_of_memory = describe_fault(exc), is_out_of_memory(exc)
    if len(requests) == 1:
        request = requests[0]
        what = "out of memory scoring this request alone" if out_of_memory else "the engine failed on this request"
        log.warning("request %s (%d tokens): %s: %s", request.request_id, request.num_tokens, what, cause,
                    exc_info=None if isinstance(exc, RequestFailed) else exc)
        return [RequestFailed(f"{what} ({request.num_tokens} tokens): {cause}", out_of_memory=out_of_memory)]
    log.warning("a batch of %d requests failed (%s); scoring it in halves to find the request at fault",
                len(requests), cause)
    half = len(requests) // 2
    return [*await _score_part(engine, requests[:half], wanted), *await _score_part(engine, requests[half:], wanted)]


def _checked(requests: list[EngineRequest], outcomes: list[Outcome]) -> list[Outcome]:
    if len(outcomes) != len(requests):
        raise EngineError(f"engine answered {len(outcomes)} outcomes for a batch of {len(requests)}")
    return outcomes
