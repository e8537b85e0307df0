"""The HTTP shell (FastAPI): proctor's scoring endpoints and vLLM's and SGLang's scoring surfaces on one port.

`POST /v1/score` takes `application/json` or `application/x-protobuf` and answers in the
request's format unless `Accept` asks for the other. Errors are `{"error": {"code",
"message", "field"}}` with the contract's status codes; 429/503 carry `Retry-After`.
A client that disconnects cancels its request, which then leaves the queue.

The app is split as vLLM's entrypoints are: request models (`models`, `openai_compat`, `tito_compat`,
`sglang_compat`), a thin router (`router`), serving code over the service (`score_serving`,
`completions_serving`, `tokenize_serving`, `tito_serving`, `sglang_serving`; `teacher_paths` puts each
teacher at its own base path), answers built by `Responses`, error answers in `errors`, and
cancellation on disconnect in `cancellation`. This module assembles them, with the bearer
token check in front.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from proctor.server.common.errors import Code, ScoringError
from proctor.server.front.auth import TokenAuth
from proctor.server.front.http.admin_serving import AdminServing
from proctor.server.front.http.completions_serving import CompletionsServing
from proctor.server.front.http.errors import error_response
from proctor.server.front.http.router import Serving, router
from proctor.server.front.http.score_serving import ScoreServing
from proctor.server.front.http.sglang_serving import SglangServing
from proctor.server.front.http.teacher_paths import TeacherPaths
from proctor.server.front.http.tito_serving import TitoServing
from proctor.server.front.http.tokenize_serving import TokenizeServing
from proctor.server.front.responses import Responses
from proctor.server.front.service import ScoringService
from proctor.server.front.settings import ServerOptions


class BearerTokenMiddleware:
    """Plain ASGI middleware: refuses calls without the token, otherwise passes the ASGI
    channels through untouched (Starlette's `@app.middleware("http")` wraps `receive`, which
    hides a client's disconnect from the handler and so would keep cancelled work running)."""

    def __init__(self, app: ASGIApp, *, auth: TokenAuth, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.auth = auth
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope.get("headers") or ())
            value = headers.get(b"authorization")
            if not self.auth.allows(value.decode("latin-1") if value is not None else None):
                error = ScoringError(Code.UNAUTHENTICATED, "missing or invalid bearer token (Authorization header)")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    service: ScoringService,
    responses: Responses,
    options: ServerOptions,
    *,
    auth: TokenAuth | None = None,
) -> FastAPI:
    """The HTTP app over `service`: every route of `router`, behind the token when set."""
    auth = auth or TokenAuth(None)
    app = FastAPI(title="proctor", version="1", summary="Teacher scoring for on-policy distillation")
    if auth.enabled:
        app.add_middleware(BearerTokenMiddleware, auth=auth, open_paths=options.open_paths)
    app.add_middleware(TeacherPaths)  # added last, so outermost: the token check sees the path unprefixed
    limit = options.max_message_bytes
    completions = CompletionsServing(service, responses, max_body_bytes=limit)
    app.state.serving = Serving(
        service,
        ScoreServing(service, responses, max_body_bytes=limit),
        completions,
        TokenizeServing(service, completions.tokenizers, max_body_bytes=limit),
        SglangServing(service, responses, completions.tokenizers, max_body_bytes=limit),
        TitoServing(service, responses, completions.tokenizers, max_body_bytes=limit),
        AdminServing(service, token_set=auth.enabled, cache_dir=options.checkpoint_cache_dir),
    )
    app.include_router(router)
    return app
