"""One teacher per base URL, and which surface a call came through.

Clients that take only a URL (slime's per-domain teacher URLs, lm-eval's `base_url`, an SGLang
`/generate` caller, which has no `model` field at all) reach one teacher of a multi-teacher
server at its own base path: `/teachers/{key}/...` serves every route of the HTTP port for the
teacher that `key` routes to (`/teachers/math/v1/completions`, `/teachers/math/generate`,
`/teachers/math/health`, ...; a key holding "/" is percent-encoded: `/teachers/openai%2Fgsm8k/...`).
`TeacherPaths` strips the prefix before routing, so each route is
written once, and leaves the key in the call's scope; `routing_key` is the one rule that turns
that key and a body's own (`model`, `teacher_key`) into the key the service routes by.

The same middleware names the call's surface for the metrics (`common.metrics.SURFACE`): one
table, `SURFACES`, maps each scoring path to the protocol it speaks, so every shell is counted
under its own label without a metric of its own.
"""

from __future__ import annotations

from urllib.parse import unquote

from starlette.types import ASGIApp, Receive, Scope, Send

from proctor.server.common.errors import ScoringError, invalid
from proctor.server.common.metrics import SURFACE
from proctor.server.front.fleet.routing import Router

PREFIX = "/teachers/"
_KEY_STATE = "proctor_teacher_key"

# Scoring path -> the protocol it speaks, as the metrics label it (`proctor:requests{surface}`).
SURFACES = {
    "/v1/score": "proctor_http",
    "/v1/score/stream": "proctor_http",
    "/v1/completions": "openai_completions",
    "/inference/v1/generate": "vllm_generate",
    "/generate": "sglang_generate",
}
OTHER_HTTP = "http_other"


def split_teacher_path(raw_path: str) -> tuple[str | None, str]:
    """(`key`, the rest, decoded) of a `/teachers/{key}/rest` path as sent (percent-encoded: a key
    holding "/", as `openai/gsm8k` does, is sent as `openai%2Fgsm8k`); (None, path) otherwise."""
    if not raw_path.startswith(PREFIX):
        return None, unquote(raw_path)
    key, slash, rest = raw_path[len(PREFIX):].partition("/")
    if not key:
        return None, unquote(raw_path)
    return unquote(key), unquote("/" + rest if slash else "/")


class TeacherPaths:
    """Plain ASGI middleware: `/teachers/{key}/rest` is served as `/rest` for `key`'s teacher,
    and every HTTP call is labelled with its surface. The outermost layer, so the token check
    and the routes see the path without its prefix."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope.get("raw_path")
        key, path = split_teacher_path(raw.decode("latin-1") if raw else scope["path"])
        if key is not None:
            scope = {**scope, "path": path, "raw_path": path.encode(),
                     "root_path": scope.get("root_path", "") + PREFIX + key,
                     "state": {**scope.get("state", {}), _KEY_STATE: key}}
        else:
            path = scope["path"]
        token = SURFACE.set(SURFACES.get(path, OTHER_HTTP))
        try:
            await self.app(scope, receive, send)
        finally:
            SURFACE.reset(token)


def path_key(scope_state: dict | None) -> str | None:
    """The teacher key of the call's base path (`/teachers/{key}/`), None without one."""
    return (scope_state or {}).get(_KEY_STATE)


def routing_key(router: Router, path: str | None, named: str, field: str) -> str:
    """The key a call routes by: its base path's when it has one, else the body's own (`named`,
    the body's `field`). A body that names another teacher than its path is refused (fail
    closed: the caller meant one of the two), a body naming the path's teacher or none is served."""
    if path is None:
        return named
    if named and named != path:
        served = router.route(path)
        try:
            other = router.route(named)
        except ScoringError:
            other = None
        if other is not served:
            raise invalid(field, f"{named!r} is not a key of teacher {served.name!r}, which the path "
                          f"/teachers/{path}/ serves: leave {field} out, or name that teacher")
    return path
