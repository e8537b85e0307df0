"""What one HTTP connection may hold: its request headers in bounded time, and a place among a
bounded number of connections; and the metrics port that serves `/metrics` only.

uvicorn times out a keep-alive connection between requests, but not one that never finishes a
request's headers: 2,000 sockets opened and left silent were kept forever. `limited_protocol`
wraps the protocol uvicorn would pick (httptools, else h11): a connection whose request has not
begun within `header_timeout_s` of opening, or of its previous answer, is closed; one opened past
`max_connections` is closed at once. A request being answered is never cut (streams run long).

The metrics port is plain HTTP beside the API port (no TLS, no token: scrapers are kept there),
so it serves `/metrics` and answers 404 to any other path.
"""

from __future__ import annotations

import asyncio
import socketserver
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from uvicorn.protocols.http.auto import AutoHTTPProtocol


def limited_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a header timeout and a connection cap."""
    base: Any = AutoHTTPProtocol

    class Limited(base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()
                return
            self._arm(None)

        def _arm(self, cycle: Any) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._check_headers, cycle)

        def _check_headers(self, armed: Any) -> None:
            """Close when no request began since the timer was armed and none is being answered."""
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is armed and (cycle is None or cycle.response_complete):
                self.transport.close()
                return
            self._arm(cycle)

        def connection_lost(self, exc: Exception | None) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return Limited


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:  # scrapes are not worth a log line each
        pass


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> tuple[WSGIServer, int]:
    """A thread serving `registry` at `/metrics` only; the server and its port."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Any) -> Any:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"this port serves /metrics only\n"]
        return metrics(environ, start_response)

    server = make_server(host, port, app, _ThreadingServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="proctor-metrics", daemon=True).start()
    return server, server.server_port
