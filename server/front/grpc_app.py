"""The gRPC shell (grpc.aio): decode, call the service, encode; errors become statuses.

Also serves `grpc.health.v1` (overall and per service; NOT_SERVING while loading or
draining) and server reflection. A bearer token, when configured, is checked by an
interceptor for the scoring service only; health and reflection stay open for probes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.wire import GRPC_PUSHBACK_KEY, GRPC_RETRY_AFTER_KEY
from proctor.server.common.errors import ScoringError, invalid
from proctor.server.common.metrics import SURFACE
from proctor.server.front.auth import TokenAuth
from proctor.server.front.responses import Responses
from proctor.server.front.service import ScoringService
from proctor.server.front.settings import ServerOptions

log = logging.getLogger(__name__)

SERVICE_NAME = scoring_pb2.DESCRIPTOR.services_by_name["TeacherScoring"].full_name


async def _abort(context: grpc.aio.ServicerContext, error: ScoringError) -> NoReturn:
    """End the call with `error`'s status (raises, as `context.abort` does). A call that has
    already ended (its deadline passed or its client left while the error was on its way) has
    nobody to answer: one debug line and CancelledError, which grpc.aio takes quietly, where
    aborting it would fail in core and be logged as a traceback at ERROR."""
    if context.cancelled() or context.done():
        _ended(context, error)
    metadata = []
    if error.retry_after is not None:
        metadata.append((GRPC_RETRY_AFTER_KEY, f"{error.retry_after:g}"))
        metadata.append((GRPC_PUSHBACK_KEY, str(int(error.retry_after * 1000))))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    try:
        await context.abort(error.code.grpc_status, error.message)
    except grpc.aio.AbortError:
        raise
    except grpc.aio.InternalError:  # core's "execute_batch" failed: the call ended in between
        _ended(context, error)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def _ended(context: grpc.aio.ServicerContext, error: ScoringError) -> NoReturn:
    log.debug("call ended before its error could be sent (%s: %s)", error.code.name, error.message)
    raise asyncio.CancelledError


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining)


def _parse(raw: bytes, message_type: type[Message]) -> Message:
    """A request message from its wire bytes; undecodable bytes are bad input (INVALID_ARGUMENT
    naming the body), where gRPC's own deserializer would answer UNKNOWN."""
    message = message_type()
    try:
        message.ParseFromString(raw)
    except DecodeError as exc:
        raise invalid("body", f"is not a valid {message_type.DESCRIPTOR.name} protobuf ({exc})") from None
    return message


def _serializer(response_type: type[Message]):
    """Answers are messages or, for scoring, bytes already serialised (`responses` splices them)."""

    def serialize(answer: Message | bytes) -> bytes:
        return answer if isinstance(answer, bytes) else response_type.SerializeToString(answer)

    return serialize


async def _parsed(raw: bytes, context: grpc.aio.ServicerContext, message_type: type[Message]) -> Message:
    """The request a handler received as raw bytes (see `_parse`); a bad one aborts the call
    (`context.abort` raises), so a handler never runs on it."""
    try:
        return _parse(raw, message_type)
    except ScoringError as error:
        await _abort(context, error)
        raise  # not reached: abort raises


def _unary(method, message_type: type[Message], response_type: type[Message]) -> grpc.RpcMethodHandler:
    """A unary handler that receives raw bytes and parses them itself."""

    async def handle(raw, context):
        return await method(await _parsed(raw, context, message_type), context)

    return grpc.unary_unary_rpc_method_handler(handle, response_serializer=_serializer(response_type))


def _streaming(method, message_type: type[Message], response_type: type[Message]) -> grpc.RpcMethodHandler:
    """A server-streaming handler that receives raw bytes and parses them itself."""

    async def handle(raw, context):
        request = await _parsed(raw, context, message_type)
        async for item in method(request, context):
            yield item

    return grpc.unary_stream_rpc_method_handler(handle, response_serializer=_serializer(response_type))


def add_scoring_service(servicer: TeacherScoringServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated `add_TeacherScoringServicer_to_server`, but
    with request parsing moved into the handlers (no request_deserializer), so that bytes that
    are not a valid request get INVALID_ARGUMENT rather than UNKNOWN."""
    handlers = {
        "Score": _unary(servicer.Score, scoring_pb2.ScoreRequest, scoring_pb2.ScoreResponse),
        "ScoreStream": _streaming(servicer.ScoreStream, scoring_pb2.ScoreRequest, scoring_pb2.ScoreChunk),
        "ListTeachers": _unary(servicer.ListTeachers, scoring_pb2.TeachersRequest, scoring_pb2.TeachersResponse),
        "GetUnembedding": _streaming(
            servicer.GetUnembedding, scoring_pb2.UnembeddingRequest, scoring_pb2.TensorChunk
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class TeacherScoringServicer(scoring_pb2_grpc.TeacherScoringServicer):
    def __init__(self, service: ScoringService, responses: Responses) -> None:
        self.service = service
        self.responses = responses

    async def Score(self, request, context):
        SURFACE.set("grpc")  # this call's task alone: each gRPC call runs in its own
        try:
            scored = await self.service.score(request, timeout=_deadline(context), unary=True)
        except ScoringError as error:
            await _abort(context, error)
        return self.responses.protobuf(scored)

    async def ScoreStream(self, request, context) -> AsyncIterator[bytes]:
        SURFACE.set("grpc")
        try:
            scored = await self.service.score(request, timeout=_deadline(context), unary=False)
        except ScoringError as error:
            await _abort(context, error)
            return
        for chunk in self.responses.chunks(scored):
            yield chunk

    async def ListTeachers(self, request, context):
        return scoring_pb2.TeachersResponse(teachers=self.service.teacher_infos(),
                                            student_tokenizers=self.service.aligned.student_infos())

    async def GetUnembedding(self, request, context) -> AsyncIterator[scoring_pb2.TensorChunk]:
        try:
            weight, fingerprint = await self.service.unembedding(request.teacher_key, request.projected)
        except ScoringError as error:
            await _abort(context, error)
            return
        for chunk in self.responses.unembedding(weight, fingerprint):
            yield chunk


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects scoring calls without the right bearer token; other services pass."""

    def __init__(self, auth: TokenAuth) -> None:
        self.auth = auth

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token (authorization metadata)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not self.auth.enabled or not method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.auth.allows(metadata.get("authorization")):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


class PortUnavailable(OSError):
    """A port the server was told to listen on cannot be bound (taken, or not an address of this
    machine): one line for the operator, naming the setting to change, never a traceback."""

    def __init__(self, address: str, transport: str, setting: str, why: str = "in use or not an address here") -> None:
        super().__init__(f"{address} ({transport}) cannot be bound ({why}): choose another port "
                         f"(--{setting.replace('_', '-')} / server.{setting}; 0: any free port) or host")


class GrpcServer:
    """Owns the grpc.aio server, its health servicer and the port it bound."""

    def __init__(
        self,
        service: ScoringService,
        responses: Responses,
        options: ServerOptions,
        *,
        auth: TokenAuth | None = None,
        tls: tuple[bytes, bytes, bytes | None] | None = None,
    ) -> None:
        max_message_bytes = options.max_message_bytes
        self.service = service
        self.health = health_aio.HealthServicer()
        channel_options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(interceptors=[AuthInterceptor(auth or TokenAuth(None))], options=channel_options)
        add_scoring_service(TeacherScoringServicer(service, responses), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        address = f"{options.host}:{options.grpc_port}"
        try:
            if tls is not None:
                cert, key, client_ca = tls
                credentials = grpc.ssl_server_credentials(
                    [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
                )
                self.port = self.server.add_secure_port(address, credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio's "Failed to bind to address"
            self.port = 0
        if self.port == 0:
            raise PortUnavailable(address, "gRPC", "grpc_port")

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(False)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(grace)

