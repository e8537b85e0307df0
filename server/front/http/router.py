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
from proctor.server.front.http.sglang_compat import GenerateBody
from proctor.server.front.http.sglang_serving import SglangServing
from proctor.server.front.http.tito_compat import GenerateBody as TitoBody
from proctor.server.front.http.tito_serving import TitoServing
from proctor.server.front.http.tokenize_serving import TokenizeServing
from proctor.server.front.service import ScoringService


@dataclass(frozen=True)
class Serving:
    """What an app's routes call: the service, proctor's scoring endpoints, vLLM's and SGLang's surfaces."""

    service: ScoringService
    score: ScoreServing
    completions: CompletionsServing
    tokenize: TokenizeServing
    sglang: SglangServing
    tito: TitoServing
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
    return await _serving(request).score.unembedding(request, teacher_key, projected)


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
@router.get("/health", summary="vLLM's readiness probe: 200 when every teacher (or the base path's) can score")
async def health(request: Request) -> Response:
    return Response(status_code=200 if _serving(request).completions.ready(request) else 503)


@router.get("/v1/models", summary="One entry per teacher (the base path's alone), as vLLM lists its model (id: the teacher key)")
async def models(request: Request) -> Response:
    return _serving(request).completions.models(request)


@router.post("/v1/completions", summary="vLLM-compatible scoring: prompt_logprobs, or echo + logprobs with the greedy next token",
             openapi_extra=CompletionBody.openapi_body())
async def completions(request: Request) -> Response:
    return await _serving(request).completions.complete(request)


@router.post("/tokenize", summary="vLLM's /tokenize: text (or chat messages) as the teacher's token ids")
async def tokenize(request: Request) -> Response:
    return await _serving(request).tokenize.tokenize(request)


@router.post("/detokenize", summary="vLLM's /detokenize: the teacher's token ids as text")
async def detokenize(request: Request) -> Response:
    return await _serving(request).tokenize.detokenize(request)


@router.get("/tokenizer_info", summary="vLLM's /tokenizer_info: the teacher's tokenizer settings and chat template")
async def tokenizer_info(request: Request) -> Response:
    return await _serving(request).tokenize.info(request)
# SGLang's native surface over the same service (its requests name no model: the path's teacher).
@router.post("/generate", summary="SGLang-compatible scoring: input_ids or text, max_new_tokens 0, return_logprob",
             openapi_extra=GenerateBody.openapi_body())
async def generate(request: Request) -> Response:
    return await _serving(request).sglang.generate(request)


@router.get("/health_generate", summary="SGLang's deep health probe: 200 when every teacher can score")
async def health_generate(request: Request) -> Response:
    return _serving(request).sglang.health_generate()


@router.get("/get_model_info", summary="SGLang's model info of the teacher (the path's, or the only one)")
@router.get("/model_info", include_in_schema=False)
async def model_info(request: Request) -> Response:
    return await _serving(request).sglang.model_info(request)


@router.get("/get_server_info", summary="SGLang's server info: the settings its clients read")
@router.get("/server_info", include_in_schema=False)
async def server_info(request: Request) -> Response:
    return await _serving(request).sglang.server_info(request)
@router.post("/inference/v1/generate", summary="vLLM's token-in-token-out teacher scoring: prompt_logprobs and "
             "prompt_logprob_token_ids (a base64 .npy float32 [rows, K]), max_tokens 1",
             openapi_extra=TitoBody.openapi_body())
async def vllm_generate(request: Request) -> Response:
    return await _serving(request).tito.generate(request)
