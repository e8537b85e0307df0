"""gRPC transport (grpc.aio): the default, one HTTP/2 channel multiplexing every call.

The channel reconnects quickly (100 ms, at most 2 s between tries) so that a restarted
server is found again within the client's retry budget instead of after gRPC's default
reconnect backoff of up to two minutes. A cancelled await cancels the RPC, which the server
sees as CANCELLED and withdraws from its queue.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence

import grpc

from proctor.client.transports import PAYLOAD_TOO_LARGE, TeacherError, Transport, make_error
from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.wire import GRPC_PUSHBACK_KEY, GRPC_RETRY_AFTER_KEY


def _retry_hint(metadata: Sequence[tuple[str, str]] | None) -> float | None:
    values = dict(metadata or ())
    if GRPC_PUSHBACK_KEY in values:
        try:
            return max(0.0, float(values[GRPC_PUSHBACK_KEY]) / 1000.0)
        except ValueError:
            pass
    if GRPC_RETRY_AFTER_KEY in values:
        try:
            return max(0.0, float(values[GRPC_RETRY_AFTER_KEY]))
        except ValueError:
            pass
    return None


# gRPC reports a message over grpc.max_{send,receive}_message_length, on either side, as
# RESOURCE_EXHAUSTED with one of these details; unlike a full queue it can never pass later.
_MESSAGE_TOO_LARGE = re.compile(r"(Received|Sent) message larger than max", re.IGNORECASE)


def error_from_rpc(exc: grpc.aio.AioRpcError) -> TeacherError:
    code = exc.code()
    trailing = exc.trailing_metadata()
    hint = _retry_hint(list(trailing) if trailing else None)
    details = exc.details() or code.name
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and _MESSAGE_TOO_LARGE.search(details):
        return make_error(PAYLOAD_TOO_LARGE, f"body: {details}", field="body")
    if code is grpc.StatusCode.CANCELLED:
        # Our own cancellations surface as asyncio.CancelledError, never as a status: a
        # CANCELLED status means the server dropped the call (it is stopping), so the
        # request is as retryable as any other UNAVAILABLE one.
        return make_error("UNAVAILABLE", f"the server cancelled the call ({details})", retry_after=hint)
    return make_error(code.name, details, retry_after=hint)


class GrpcTransport(Transport):
    name = "grpc"

    def __init__(
        self,
        address: str,
        *,
        secure: bool = False,
        token: str | None = None,
        max_message_bytes: int = 64 << 20,
        root_certificates: bytes | None = None,
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.enable_retries", 0),  # the client retries itself, with the server's hint
        ]
        if secure:
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = scoring_pb2_grpc.TeacherScoringStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    @staticmethod
    async def _unary(call):
        """Await a unary call: cancelling the wait cancels it on the server, errors become TeacherErrors."""
        try:
            return await call
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def score(self, request, timeout):
        return await self._unary(self._stub.Score(request, timeout=timeout, metadata=self._metadata))

    async def _stream(self, call) -> AsyncIterator:
        try:
            async for item in call:
                yield item
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            if not call.done():
                call.cancel()

    def score_stream(self, request, timeout) -> AsyncIterator[scoring_pb2.ScoreChunk]:
        return self._stream(self._stub.ScoreStream(request, timeout=timeout, metadata=self._metadata))

    async def list_teachers(self, timeout):
        return await self._unary(
            self._stub.ListTeachers(scoring_pb2.TeachersRequest(), timeout=timeout, metadata=self._metadata)
        )

    def unembedding(self, teacher_key, timeout, *, projected=False) -> AsyncIterator[scoring_pb2.TensorChunk]:
        request = scoring_pb2.UnembeddingRequest(teacher_key=teacher_key, projected=projected)
        return self._stream(self._stub.GetUnembedding(request, timeout=timeout, metadata=self._metadata))

    async def close(self) -> None:
        await self._channel.close()
