"""The HTTP routes: paths, methods and their OpenAPI text, each handing its call to the serving
code that owns it (as vLLM's `api_router` does), and nothing else.

The handlers are module-level, so one router serves every app built in a process; each call
finds its app's serving objects in `app.state.serving` (`create_app` puts them there).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf.json_format import MessageToDict

from proctor.proto import scoring_pb2
from proctor.server.front.fleet.replicas import ReplicaState
from proctor.server.front.http.admin_serving import AdminServing
from proctor.server.front.http.completions_serving import CompletionsServing
from proctor.server.front.http.openai_compat import CompletionBody
from proctor.server.front.http.score_serving import SCORE_OPENAPI, ScoreServing
from proctor.server.front.service import ScoringService


@dataclass(frozen=True)
class Serving:
    """What an app's routes call: the service, proctor's scoring endpoints, vLLM's surface."""

    service: ScoringService
    score: ScoreServing
    completions: CompletionsServing
    admin: AdminServing


def _serving(request: Request) -> Serving:
    return request.app.state.serving


router = APIRouter()


@router.post("/v1/score", summary="Score one sequence with a teacher", openapi_extra=SCORE_OPENAPI)
async def score(request: Request) -> Response:
    return await _serving(request).score.score(request)


@router.post(
    "/v1/score/stream",
    summary="Score one sequence; the answer is length-delimited ScoreChunk messages (hidden states in whole rows)",
    openapi_extra=SCORE_OPENAPI,
)
async def score_stream(request: Request) -> Response:
    return await _serving(request).score.score_stream(request)


@router.get("/v1/unembedding", summary="The teacher's lm_head [V, H] as length-delimited TensorChunk messages of whole rows")
async def unembedding(request: Request, teacher_key: str = "", projected: bool = False) -> Response:
    return await _serving(request).score.unembedding(teacher_key, projected)


@router.get("/v1/teachers", summary="The teachers this server scores with, and its student tokenizers")
async def teachers(request: Request) -> dict:
    service = _serving(request).service
    answer = scoring_pb2.TeachersResponse(teachers=service.teacher_infos(), student_tokenizers=service.aligned.student_infos())
    return MessageToDict(answer, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


@router.get("/health/live", summary="The process is up")
async def live(request: Request) -> dict:
    return {"status": "live", "state": _serving(request).service.state.value}


@router.get("/health/ready", summary="Every teacher has a healthy replica and the server admits work")
async def ready(request: Request) -> Response:
    service = _serving(request).service
    if service.ready():
        degraded = [f"{t.name}/{r.replica_id}" for t in service.router.teachers.values() for r in t.replicas
                    if r.state is ReplicaState.DEGRADED]  # drifting (`drift`): served only when no other is healthy
        return JSONResponse({"status": "ready", **({"degraded": degraded} if degraded else {})})
    return JSONResponse({"status": "not ready", "state": service.state.value}, status_code=503)


@router.post("/admin/teachers/{name}/checkpoint",
             summary="Move a teacher to another step ({dist_ckpt_path} or {model_path}), replica by replica")
async def move_checkpoint(request: Request, name: str) -> Response:
    return await _serving(request).admin.move_checkpoint(request, name)


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_serving(request).service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# vLLM's scoring surface over the same service.
@router.get("/health", summary="vLLM's readiness probe: 200 when every teacher can score")
async def health(request: Request) -> Response:
    return Response(status_code=200 if _serving(request).service.ready() else 503)


@router.get("/v1/models", summary="One entry per teacher, as vLLM lists its model (id: the teacher key)")
async def models(request: Request) -> dict:
    return _serving(request).completions.models()


@router.post("/v1/completions", summary="vLLM-compatible scoring: token-id prompts, max_tokens 1, prompt_logprobs",
             openapi_extra=CompletionBody.openapi_body())
async def completions(request: Request) -> Response:
    return await _serving(request).completions.complete(request)
