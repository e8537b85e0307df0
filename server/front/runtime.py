"""Runs a scoring service behind both transports in one event loop, and drains it on SIGTERM.

One process and one loop own the service, so admission counts and metrics are exact and the
gRPC and HTTP servers share the same batches. `ProctorServer` is what `proctor serve` runs;
`ServerThread` runs one in a background thread (tests, benchmarks, the demo).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import uvicorn

from proctor.server.front.auth import TokenAuth
from proctor.server.front.fleet.routing import Router
from proctor.server.front.grpc_app import GrpcServer, PortUnavailable
from proctor.server.front.http.app import create_app
from proctor.server.front.http.limits import limited_protocol, serve_metrics
from proctor.server.front.responses import Responses
from proctor.server.front.service import ScoringService
from proctor.server.front.settings import ServerOptions

log = logging.getLogger(__name__)


HTTP_CLOSE_GRACE_S = 5.0


def _listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP listening socket. Its protocol must be IPPROTO_TCP, not 0: asyncio sets
    TCP_NODELAY on an accepted socket only when `sock.proto == IPPROTO_TCP` (uvicorn does not
    set it at all), and accepted sockets inherit the listener's proto. Without it every
    keep-alive answer written in two parts (headers, then body) waits for the client's
    delayed ACK (Nagle's algorithm): about 40 ms per request on Linux."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortUnavailable(f"{host}:{port}", "HTTP", "http_port", exc.strerror or str(exc)) from None
    return sock


class _HttpServer(uvicorn.Server):
    """uvicorn without its signal handlers: `Server.serve` wraps the server in
    `capture_signals()`, which replaces the process's SIGTERM/SIGINT handlers with one that
    stops HTTP at once (new connections refused, in-flight requests cut after
    timeout_graceful_shutdown) and re-raises the signal afterwards. ProctorServer owns the
    signals: it drains first, with both transports still answering UNAVAILABLE / 503."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ProctorServer:
    """The service plus its gRPC and HTTP servers, started and stopped together."""

    def __init__(self, router: Router, options: ServerOptions) -> None:
        self.options = options
        limits = replace(options.limits, max_answer_bytes=options.max_message_bytes // 2)
        self.service = ScoringService(router, limits=limits, student_tokenizers=options.student_tokenizers)
        auth = TokenAuth(options.auth_token)
        tls = None
        if options.tls_cert_file and options.tls_key_file:
            client_ca = Path(options.tls_client_ca_file).read_bytes() if options.tls_client_ca_file else None
            tls = (Path(options.tls_cert_file).read_bytes(), Path(options.tls_key_file).read_bytes(), client_ca)
        responses = Responses(self.service.metrics, chunk_bytes=options.stream_chunk_bytes)
        self.grpc = GrpcServer(self.service, responses, options, auth=auth, tls=tls)
        app = create_app(self.service, responses, options, auth=auth)
        ssl = {}
        if options.tls_cert_file and options.tls_key_file:
            ssl = {"ssl_certfile": options.tls_cert_file, "ssl_keyfile": options.tls_key_file}
            if options.tls_client_ca_file:
                import ssl as ssl_module

                ssl.update(ssl_ca_certs=options.tls_client_ca_file, ssl_cert_reqs=ssl_module.CERT_REQUIRED)
        self._http_socket = _listening_socket(options.host, options.http_port)
        self.http_port = self._http_socket.getsockname()[1]
        # Drain happens before the HTTP server is told to stop (drain_and_stop), so its own
        # graceful shutdown only has answers already computed left to write.
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=HTTP_CLOSE_GRACE_S,
                                http=limited_protocol(options.http_header_timeout_s, options.http_max_connections),
                                **ssl)
        self.http = _HttpServer(config)
        self._http_task: asyncio.Task | None = None
        self._metrics_server = None
        self.metrics_port: int | None = None
        self.stopped = asyncio.Event()

    @property
    def grpc_port(self) -> int:
        return self.grpc.port

    async def start(self) -> None:
        await self.grpc.start()
        self._http_task = asyncio.get_running_loop().create_task(self.http.serve(sockets=[self._http_socket]))
        if self.options.metrics_port is not None:
            self._metrics_server, self.metrics_port = serve_metrics(
                self.options.host, self.options.metrics_port, self.service.metrics.registry)
        await self.service.start()
        await self.grpc.set_serving(True)
        log.info("proctor serving: gRPC %s:%d, HTTP %s:%d", self.options.host, self.grpc_port,
                 self.options.host, self.http_port)

    async def drain_and_stop(self, grace_s: float | None = None, *, close_grpc: bool = True) -> bool:
        """Stop admitting, finish in-flight requests (up to grace_s), then stop everything (with
        close_grpc=False, all but the gRPC server, which goes on answering UNAVAILABLE)."""
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        await self.grpc.set_serving(False)
        finished = await self.service.drain(grace)
        await self.stop(close_grpc=close_grpc)
        return finished

    async def stop(self, *, close_grpc: bool = True) -> None:
        await self.grpc.set_serving(False)
        if close_grpc:
            await self.grpc.stop(1.0)
        self.http.should_exit = True
        if self._http_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._http_task, timeout=10)
        await self.service.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        self.stopped.set()

    async def serve_until_terminated(self) -> NoReturn:
        """Run until SIGTERM/SIGINT, drain, and end the process with exit code 0.

        The gRPC server is never shut down by gRPC core: core's shutdown fails every call it has
        received but not yet handed to a handler, and every call that reaches a connection before
        the client has read the GOAWAY, with CANCELLED, which a stock client does not retry
        (one to three a drain under twelve stock clients in a tight loop; tests/test_drain_exit.py).
        Instead it goes on answering UNAVAILABLE while HTTP, the replicas and the metrics server
        stop, and the process ends under it: a call racing the end sees its connection closed,
        which every gRPC client reports as UNAVAILABLE."""
        from proctor.server.common.malloc_tuning import keep_large_buffers

        keep_large_buffers()  # this process serves: its answers' buffers are reused, not re-faulted
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop_requested.set)
        await self.start()
        await stop_requested.wait()
        log.info("signal received: draining (grace %.0fs)", self.options.drain_grace_s)
        finished = await self.drain_and_stop(close_grpc=False)
        if not finished:
            log.warning("grace period over with requests still in flight")
        end_process(0)


def end_process(code: int) -> NoReturn:
    """End this process now, under a running event loop: exit handlers (logging, Ray's) run and
    standard streams are flushed, but the loop is not torn down, so no request task is
    cancelled into a CANCELLED answer; the kernel closes the sockets."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class ServerThread:
    """A ProctorServer on its own event loop in a daemon thread (tests, demo, benchmarks)."""

    def __init__(self, router: Router, options: ServerOptions) -> None:
        self._router = router
        self._options = options
        self.loop = asyncio.new_event_loop()
        self.server: ProctorServer | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="proctor-server", daemon=True)

    def start(self, timeout: float = 300, *, wait: bool = True) -> ServerThread:
        """Start serving; with wait=False return as soon as the ports are bound (engines may still load)."""
        self._thread.start()
        bound = threading.Event()

        async def boot():
            self.server = ProctorServer(self._router, self._options)
            bound.set()
            await self.server.start()

        loading = asyncio.run_coroutine_threadsafe(boot(), self.loop)
        if wait:
            loading.result(timeout)
        else:
            bound.wait(timeout)
            self.loading = loading
        return self

    def call(self, coro, timeout: float = 300):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def grpc_target(self) -> str:
        return f"{self._options.host}:{self.server.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self._options.host}:{self.server.http_port}"

    def stop(self) -> None:
        """Stop serving and end the loop; calling it again does nothing."""
        if not self._thread.is_alive():
            return
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.call(self.server.stop(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
