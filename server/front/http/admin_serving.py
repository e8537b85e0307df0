"""`POST /admin/teachers/{name}/checkpoint`: point a teacher at another step while it serves.

A thin shell over `fleet.checkpoint_move`: the body (`{"dist_ckpt_path": ...}` or
`{"model_path": ...}`) read under the size limit and parsed by the one JSON rule home, the
teacher found by its name, and the move's report (or its refusal, in the house error shape)
answered. An admin call changes what every trainer is scored by, so it needs the server's
bearer token: the token middleware checks it like any other path, and a server started
without a token refuses admin calls outright (401) rather than leaving them open.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proctor.server.common.errors import Code, ScoringError, invalid
from proctor.server.front.bounded_json import loads_bounded
from proctor.server.front.fleet.checkpoint_move import move_teacher
from proctor.server.front.http.errors import error_response
from proctor.server.front.http.request import read_body
from proctor.server.front.service import ScoringService

_MAX_BODY_BYTES = 64 << 10
_FIELDS = ("dist_ckpt_path", "model_path")


class AdminServing:
    """The admin calls over the service's teachers (`token_set`: the server has a bearer token)."""

    def __init__(self, service: ScoringService, *, token_set: bool, cache_dir: str | None) -> None:
        self.service = service
        self.token_set = token_set
        self.cache_dir = cache_dir

    async def move_checkpoint(self, request: Request, name: str) -> Response:
        try:
            if not self.token_set:
                raise ScoringError(Code.UNAUTHENTICATED, "admin calls need the server's bearer token "
                                   "(server.auth_token_file): this server has none")
            teacher_set = self.service.router.teachers.get(name)
            if teacher_set is None:
                raise ScoringError(Code.NOT_FOUND, f"name: no teacher {name!r} (teachers: "
                                   f"{', '.join(self.service.router.teachers)})", field="name")
            body = loads_bounded(await read_body(request, _MAX_BODY_BYTES))
            if not isinstance(body, dict):
                raise invalid("body", "must be a JSON object with dist_ckpt_path or model_path")
            unknown = sorted(set(body) - set(_FIELDS))
            if unknown:
                raise invalid(unknown[0], f"is not a field of this call (fields: {', '.join(_FIELDS)})")
            for key in _FIELDS:
                if key in body and not isinstance(body[key], str):
                    raise invalid(key, "must be a string (a path on the server)")
            report = await move_teacher(teacher_set, dist_ckpt_path=body.get("dist_ckpt_path"),
                                        model_path=body.get("model_path"), cache_dir=self.cache_dir)
        except ScoringError as exc:
            return error_response(exc)
        return JSONResponse(report.to_json())
