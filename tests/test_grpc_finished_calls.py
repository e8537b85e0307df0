"""An error answered on a gRPC call that has already ended (its deadline passed, its client left) is
one quiet line, not an ERROR traceback from grpc's core.

In a soak, about one call a run is cancelled by its deadline at the very moment the service's own
deadline raises: `Score` then aborts a call core has finished, and `context.abort` fails with
`ExecuteBatchError`, which grpc.aio logs as a 50-line traceback at ERROR. Here the race is made
certain: the handler outlives its call's deadline on purpose, then answers its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest

from proctor.server.common.errors import Code, ScoringError
from proctor.server.front.grpc_app import _abort


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _late_abort_round() -> tuple[grpc.StatusCode, list[BaseException], list[logging.LogRecord]]:
    raised: list[BaseException] = []
    finished = asyncio.Event()

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        # Past the client's deadline (core ends the call meanwhile), then an error answered
        # anyway, as a service timer racing the deadline does.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.5)
        await asyncio.sleep(0.2)
        try:
            await _abort(context, ScoringError(Code.DEADLINE_EXCEEDED, "not scored within the deadline"))
        except BaseException as exc:
            raised.append(exc)
            raise
        finally:
            finished.set()
        return b""

    errors = _Errors()
    logging.getLogger().addHandler(errors)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"M": grpc.unary_unary_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await channel.unary_unary("/t.T/M")(b"", timeout=0.1)
        await asyncio.wait_for(finished.wait(), 5)
        await asyncio.sleep(0.1)  # the server's exception handling logs after the handler ends
    finally:
        await server.stop(None)
        logging.getLogger().removeHandler(errors)
    return failed.value.code(), raised, errors.records


def test_error_on_a_call_already_ended_is_quiet():
    code, raised, records = asyncio.run(_late_abort_round())
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(raised) == 1 and isinstance(raised[0], asyncio.CancelledError), raised
    assert [record.getMessage() for record in records] == []
