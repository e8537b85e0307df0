"""The client under faults, against real servers: restarts, cancellation, deadlines,
back-pressure and authentication."""

from __future__ import annotations

import asyncio
import time

import pytest

from proctor.client import (
    NO_RETRY,
    DeadlineExceeded,
    ResourceExhausted,
    RetryPolicy,
    TeacherClient,
    Unauthenticated,
)
from proctor.server.config import single_teacher_router
from proctor.server.engines.base import EngineSpec
from proctor.server.front.service import Limits

from support.reference import assert_matches_reference
from support.routers import slow_router
from support.servers import engine_of, free_port, request_count, start_server

TRANSPORTS = ("grpc", "http")


def target(server, transport: str) -> str:
    return f"grpc://{server.grpc_target}" if transport == "grpc" else server.http_url


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir):
    """Each batch takes 1 s on top of the real forward pass."""
    server = start_server(slow_router(tiny_model_dir, 1.0, name="slow")[0])
    yield server
    server.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_server_restart_mid_run_loses_and_duplicates_nothing(tiny_model_dir, transport):
    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir))
    ports = {"grpc_port": free_port(), "http_port": free_port()}
    server = start_server(single_teacher_router(spec, name="tiny"), **ports)
    sequences = [[(7 * i + j) % 512 for j in range(8 + i % 13)] for i in range(96)]
    done = 0
    replaced = None
    try:
        async with TeacherClient(target(server, transport), max_concurrency=4,
                                 retry=RetryPolicy(max_attempts=30, max_backoff_s=0.5)) as client:

            async def counted(index, seq):
                nonlocal done
                result = await client.score(seq, request_id=f"seq-{index}")
                done += 1
                return result

            run = asyncio.gather(*(counted(i, s) for i, s in enumerate(sequences)))
            while done < 16:
                await asyncio.sleep(0.01)
            stopping, server = server, None
            await asyncio.to_thread(stopping.stop)  # mid-run: requests in flight and queued
            assert done < len(sequences)
            replaced = await asyncio.to_thread(start_server, single_teacher_router(spec, name="tiny"), **ports)
            results = await run
            assert client.retries > 0
    finally:
        for s in (server, replaced):
            if s is not None:
                s.stop()
    assert [r.request_id for r in results] == [f"seq-{i}" for i in range(len(sequences))]
    for seq, scores in zip(sequences, results, strict=True):
        assert_matches_reference(scores.logprobs, tiny_model_dir, seq, atol=1e-4)


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_cancelling_a_call_withdraws_it_from_the_server(slow_server, transport):
    engine = engine_of(slow_server, "slow")
    cancelled_before = request_count(slow_server, "cancelled")
    passes_before = engine.forward_passes
    async with TeacherClient(target(slow_server, transport)) as client:
        busy = asyncio.ensure_future(client.score([1, 2, 3, 4]))  # occupies the engine for 1 s
        await asyncio.sleep(0.2)
        queued = asyncio.ensure_future(client.score([5, 6, 7, 8]))  # waits behind it
        await asyncio.sleep(0.2)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        await busy
        deadline = time.monotonic() + 5
        while request_count(slow_server, "cancelled") == cancelled_before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    await asyncio.sleep(1.3)  # long enough for a second batch, had the server kept the request
    assert request_count(slow_server, "cancelled") == cancelled_before + 1
    assert engine.forward_passes == passes_before + 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_deadline_is_honoured(slow_server, transport):
    async with TeacherClient(target(slow_server, transport)) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as caught:
            await client.score([1, 2, 3], timeout=0.3)
        elapsed = time.monotonic() - started
    assert isinstance(caught.value, TimeoutError)
    assert 0.25 <= elapsed < 0.9
    await asyncio.sleep(1.0)  # let the server's own batch finish before the next test


async def test_full_queue_is_retried_after_the_servers_hint(tiny_model_dir):
    server = start_server(slow_router(tiny_model_dir, 0.3, name="slow")[0], limits=Limits(max_queue_requests=1))
    try:
        async with TeacherClient(target(server, "grpc"), retry=NO_RETRY) as impatient:
            first = asyncio.ensure_future(impatient.score([1, 2, 3]))
            await asyncio.sleep(0.1)
            with pytest.raises(ResourceExhausted) as caught:
                await impatient.score([4, 5, 6])
            assert caught.value.retry_after is not None and caught.value.retry_after > 0
            await first
        async with TeacherClient(target(server, "http"), retry=RetryPolicy(max_attempts=50)) as patient:
            results = await patient.score_many([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
            assert [r.num_tokens for r in results] == [3, 3, 3]
            assert patient.retries > 0
    finally:
        server.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bearer_token_is_sent_and_required(tiny_model_dir, transport):
    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir))
    server = start_server(single_teacher_router(spec, name="tiny"), auth_token="s3cret")
    try:
        async with TeacherClient(target(server, transport), retry=NO_RETRY) as anonymous:
            with pytest.raises(Unauthenticated):
                await anonymous.score([1, 2, 3])
        async with TeacherClient(target(server, transport), token="s3cret") as authorised:
            assert (await authorised.score([1, 2, 3])).num_tokens == 3
    finally:
        server.stop()
