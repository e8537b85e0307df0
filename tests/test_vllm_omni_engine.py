"""The vLLM-Omni engine's settings, configs and fault paths, with fakes of vLLM-Omni 0.30.0 where
the real library cannot be made to do what a test needs (tests/omni_fakes.py says what each fake
mirrors; each fake-backed test says in its first docstring line why it is not run on the real one).

The real vLLM-Omni 0.30.0 runs in tests/test_vllm_omni_real.py (scoring, media, hidden states,
score_ids, bad requests, a SIGKILLed stage under load), and `test_omni_fakes_match_the_real_library`
runs the fakes' config front door beside the real one on the same files. The fake's stage is a
real child process, so killing it is a real fault. Every wait is bounded (`asyncio.wait_for`), so a
regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from proctor.server.engines.base import (
    EngineConfigError,
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineSpec,
    MediaItem,
    MultiModalInputs,
    RequestAborted,
    RequestFailed,
    RequestRejected,
)
from proctor.server.engines.factory import create_engine
from proctor.server.engines.vllm_omni import engine as omni_mod
from proctor.server.engines.vllm_omni.config import PIPELINES, deploy_config, stage_config
from proctor.server.engines.vllm_omni.engine import VllmOmniEngine
from proctor.server.engines.vllm_omni.outputs import extract_hidden, stage_output
from proctor.server.engines.vllm_omni.prompts import build_prompt
from proctor.server.engines.vllm_omni.stages import classify_stage_error

from omni_fakes import (
    CLIENT_ERROR,
    ENGINE_ERROR,
    IMAGE,
    SLOW,
    FakeAsyncOmni,
    fake_omni,
    legacy_max_num_seqs,
    resolve_config,
)
from support.omni import omni_python

OMNI_KWARGS = {"output_mode": "ar", "pipeline_name": "qwen3_omni_moe"}
ROOT_TESTS = Path(__file__).resolve().parent
BOUND_S = 10.0  # no fault test may take longer than this to answer


def _omni_spec(path="/m", startup_timeout_s=60.0, **inference):
    inference.setdefault("engine_kwargs", {"vllm_omni": dict(OMNI_KWARGS)})
    return EngineSpec(name="vllm_omni", model_path=str(path), device="cuda", dtype="bfloat16", max_topk=16,
                      inference=inference, devices=("4", "5"), startup_timeout_s=startup_timeout_s)


def _faked_start(engine: VllmOmniEngine, omni, dtype: torch.dtype) -> None:
    """The engine as `start` leaves it, over a fake AsyncOmni: running, and described (its requests
    are checked against that description, `teacher_serves`)."""
    engine._omni, engine._started, engine._dtype = omni, True, dtype
    engine._info = EngineInfo(engine="vllm_omni", model="m", fingerprint="", vocab_size=1000, hidden_size=4,
                              max_model_len=64, max_topk=engine.max_logprobs, dtype=str(dtype).removeprefix("torch."),
                              outputs=("logprobs", "topk", "hidden_states", "score_ids"))


def _request(rid="r", ids=(3, 9, 4, 5, 6), *, first_row=2, topk=2, hidden=False, media=None):
    return EngineRequest(request_id=rid, token_ids=torch.tensor(list(ids)), first_row=first_row, logprobs=True,
                         topk=topk, hidden_states=hidden, media=media)


@pytest.fixture(scope="module", autouse=True)
def _vllm_imported():
    """vLLM's import (seconds on a busy machine) before any bounded start: the fakes build vLLM's
    FlatLogprobs, and BOUND_S bounds the engine, not the import."""
    import vllm.logprobs  # noqa: F401


@pytest.fixture
def model_dir(tmp_path):
    text = {"hidden_size": 4, "vocab_size": 128, "max_position_embeddings": 64, "num_attention_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps({"thinker_config": {"text_config": text}}))
    return tmp_path


class _FakedEngine(VllmOmniEngine):
    """The engine with vLLM-Omni replaced by a fake of 0.30.0 (deploy-config schema)."""

    omni_cls: type[FakeAsyncOmni] = FakeAsyncOmni

    def _async_omni_class(self):
        return self.omni_cls

    def _config_schema(self) -> str:
        return "deploy"


async def _started(model_dir, omni_cls=FakeAsyncOmni, **inference) -> _FakedEngine:
    inference.setdefault("max_model_len", 64)
    engine = _FakedEngine(_omni_spec(model_dir, **inference))
    engine.omni_cls = omni_cls
    await asyncio.wait_for(engine.start(), BOUND_S)
    return engine


async def _until(predicate, timeout=BOUND_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------------------------
# Settings and configs
# --------------------------------------------------------------------------------------------


def test_omni_requires_ar_output_mode_and_a_known_pipeline():
    from proctor.server.engines.vllm_omni.config import omni_pipeline

    assert omni_pipeline(_omni_spec()).model_arch == "Qwen3OmniMoeForConditionalGeneration"
    with pytest.raises(EngineConfigError, match='output_mode="ar"'):
        omni_pipeline(_omni_spec(engine_kwargs={"vllm_omni": {"pipeline_name": "qwen3_omni_moe"}}))
    with pytest.raises(EngineConfigError, match="pipeline_name is 'nope'"):
        omni_pipeline(_omni_spec(engine_kwargs={"vllm_omni": {"output_mode": "ar", "pipeline_name": "nope"}}))


async def test_omni_max_logprobs_is_seeded_and_validated(tmp_path):
    assert VllmOmniEngine(_omni_spec()).max_logprobs == 16
    (tmp_path / "config.json").write_text("{}")
    spec = _omni_spec(tmp_path, engine_kwargs={"vllm_omni": {**OMNI_KWARGS, "max_logprobs": 4}})
    with pytest.raises(EngineConfigError, match=r"engine_kwargs\.vllm_omni\.max_logprobs is 4"):
        await create_engine(spec).start()


def test_omni_stage_config_is_one_thinker_stage():
    spec = _omni_spec(tensor_model_parallel_size=2, gpu_memory_utilization=0.8, max_model_len=8192,
                      temperature=0.7,
                      engine_kwargs={"vllm_omni": {**OMNI_KWARGS, "max_num_seqs": 128, "max_logprobs": 32}})
    (stage,) = stage_config(spec, PIPELINES["qwen3_omni_moe"], 32)["stage_args"]
    args = stage["engine_args"]
    assert stage["runtime"] == {"devices": "0,1"} and stage["final_output"] is True
    assert args["model_stage"] == "thinker" and args["engine_output_type"] == "latent"
    assert args["hf_config_name"] == "thinker_config" and args["worker_cls"].endswith("GPUARWorker")
    assert args["tensor_parallel_size"] == 2 and args["gpu_memory_utilization"] == 0.8
    assert args["max_num_seqs"] == 128 and args["max_logprobs"] == 32 and args["dtype"] == "bfloat16"
    assert not {"output_mode", "pipeline_name", "temperature"} & set(args)
    deploy = deploy_config(spec, PIPELINES["qwen3_omni_moe"], 32)
    (deployed,) = deploy["stages"]
    assert deploy["pipeline"] == "qwen3_omni_moe_thinker_only" and deploy["dtype"] == "bfloat16"
    assert deploy["trust_remote_code"] is True and "dtype" not in deployed  # pipeline-wide: top level
    assert deployed["devices"] == "0,1" and deployed["max_num_seqs"] == 128
    # the topology owns these; 0.30.0 refuses them in a stage (test_omni_fakes_match_the_real_library)
    assert not {"model_stage", "worker_cls", "model_arch", "engine_output_type", "disable_log_stats"} & set(deployed)


def test_omni_stage_batch_size_is_the_teachers_or_256_under_vllm_omnis_rules():
    """Not run on the real 0.18.0 (the Ascend image's pin): its legacy rule, mirrored.
    0.18.0 turns runtime.max_batch_size into max_num_seqs with a default of 1: proctor's
    legacy config must not leave that to it."""
    pipeline = PIPELINES["qwen2_5_omni"]
    (stage,) = stage_config(_omni_spec(), pipeline, 16)["stage_args"]
    assert "max_batch_size" not in stage["runtime"]
    assert legacy_max_num_seqs(stage) == 256
    (stage,) = stage_config(_omni_spec(max_num_seqs=48), pipeline, 16)["stage_args"]
    assert legacy_max_num_seqs(stage) == 48
    assert deploy_config(_omni_spec(max_num_seqs=48), pipeline, 16)["stages"][0]["max_num_seqs"] == 48


async def test_omni_batch_size_reaches_the_stage(model_dir):
    """Fake: how many sequences the stage admits at once is not observable outside the real
    stage (the real resolver's max_num_seqs is checked in test_omni_fakes_match_the_real_library).
    The stage process admits max_num_seqs sequences at once: the teacher's setting, not 1."""
    engine = await _started(model_dir, max_num_seqs=3)
    try:
        assert engine._omni.max_num_seqs == 3
        batch = [_request(f"r{i}") for i in range(6)]
        outcomes = await asyncio.wait_for(engine.score(batch), BOUND_S)
        assert all(o.logprobs is not None for o in outcomes)
        assert engine._omni.stage_peak == 3
    finally:
        await engine.close()


async def test_omni_legacy_stage_configs_path_is_refused_by_0_30_schema(model_dir):
    """Fake: the engine's start path on the refusal; the real refusal is
    test_omni_fakes_match_the_real_library's.
    What proctor wrote before: a stage_args file passed as stage_configs_path fails on 0.30.0."""
    class Legacy(_FakedEngine):
        def _config_schema(self) -> str:
            return "stage_args"

    engine = Legacy(_omni_spec(model_dir, max_model_len=64))
    with pytest.raises(EngineError, match="stage_configs_path"):
        await asyncio.wait_for(engine.start(), BOUND_S)


# --------------------------------------------------------------------------------------------
# Requests and payloads
# --------------------------------------------------------------------------------------------


def test_omni_prompt_uses_the_services_decoded_media():
    from PIL import Image

    image = Image.new("RGB", (4, 4))
    media = MultiModalInputs(images=(MediaItem(b"not an image at all", "image/png"),),
                             processor_kwargs={"use_audio_in_video": False, "fps": 2},
                             decoded={"image": [image]})
    prompt = build_prompt(_request(ids=(1, 2, 3), media=media))
    assert prompt["prompt_token_ids"] == [1, 2, 3]
    assert prompt["multi_modal_data"]["image"][0] is image  # undecodable bytes were never touched
    assert prompt["mm_processor_kwargs"] == {"use_audio_in_video": False, "fps": 2}
    assert build_prompt(_request(ids=(5, 6))) == {"prompt_token_ids": [5, 6]}


def test_omni_prompt_decodes_only_when_the_service_did_not():
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    media = MultiModalInputs(images=(MediaItem(buf.getvalue(), "image/png"),))
    assert [im.size for im in build_prompt(_request(media=media))["multi_modal_data"]["image"]] == [(4, 4)]


async def test_omni_engine_scores_decoded_media_through_the_stage(model_dir):
    """Fake: it reads the objects the stage received (decoded media, never the bytes); real media
    scoring is test_vllm_omni_real's."""
    from PIL import Image

    engine = await _started(model_dir)
    try:
        image = Image.new("RGB", (2, 2))
        media = MultiModalInputs(images=(MediaItem(b"\x00garbage", "image/png"),), decoded={"image": [image]})
        (res,) = await asyncio.wait_for(engine.score([_request(ids=(3, IMAGE, 4, 5), media=media, hidden=True)]),
                                        BOUND_S)
        assert res.logprobs.tolist() == [-2.0, -3.0] and res.topk_ids.tolist() == [[7, 8]] * 2
        assert res.hidden_states.shape == (2, 4) and res.hidden_states.dtype == torch.bfloat16
        assert engine._omni.received_prompts[-1]["multi_modal_data"]["image"] == [image]
        assert engine.describe().longest_sequence == 63 and engine.describe().max_model_len == 64
    finally:
        await engine.close()


async def test_omni_engine_collapses_placeholder_runs_and_checks_the_stages_expansion(tmp_path):
    """Fake: it reads the prompts the stage received, which the real stage does not report
    (the real expansion check runs in test_vllm_omni_real's bad requests).
    A checkpoint whose config names its image placeholder: each run goes to the stage as one
    token, the stage's processor expands it again (3 tokens an image here, as vLLM's prompt
    updates do), and the answer is used only when that expansion is the ids sent."""
    from PIL import Image

    thinker = {"text_config": {"hidden_size": 4, "vocab_size": 128, "max_position_embeddings": 64,
                               "num_attention_heads": 1},
               "vision_config": {"spatial_merge_size": 2}, "image_token_index": IMAGE}
    (tmp_path / "config.json").write_text(json.dumps({"thinker_config": thinker}))
    engine = await _started(tmp_path, omni_cls=fake_omni(image_tokens=3))
    try:
        assert engine.describe().media == ("images",)  # the config names no video or audio token
        media = MultiModalInputs(images=(MediaItem(b"x", "image/png"),), decoded={"image": [Image.new("RGB", (2, 2))]})
        aligned = _request("aligned", ids=(3, IMAGE, IMAGE, IMAGE, 4, 5), first_row=4, media=media)
        short = _request("short", ids=(3, IMAGE, IMAGE, 4, 5), media=media)
        two_runs = _request("two_runs", ids=(3, IMAGE, 4, IMAGE, 5), media=media)
        ok, bad_length, bad_count = await asyncio.wait_for(engine.score([aligned, short, two_runs]), BOUND_S)
        assert ok.logprobs.tolist() == [-4.0, -5.0]  # rows 4 and 5 of the 6-token expanded prompt
        sent = [p["prompt_token_ids"] for p in engine._omni.received_prompts]
        assert [3, IMAGE, 4, 5] in sent and [3, IMAGE, IMAGE, 4, 5] not in sent
        assert isinstance(bad_length, RequestRejected) and bad_length.field == "images[0]"
        assert "has 2 tokens" in bad_length.message and "makes 3" in bad_length.message
        assert isinstance(bad_count, RequestRejected) and bad_count.field == "token_ids"
        assert all(p["prompt_token_ids"] != [3, IMAGE, 4, IMAGE, 5] for p in engine._omni.received_prompts)
    finally:
        await engine.close()


def _fake_omni_output(ids, hidden_chunks, k=2, key="latent", on_completion=True):
    """An OmniRequestOutput of 0.30.0: a flat RequestOutput (prompt_logprobs, outputs) whose
    multimodal output sits on its completion or on itself."""
    from vllm.logprobs import FlatLogprobs

    flat = FlatLogprobs()
    flat.append(None)
    for i in range(1, len(ids)):
        cands = [ids[i], 7, 8][: k + 1]
        flat.append_fast(cands, [-float(i), -0.1, -0.2][: k + 1], iter([3, 1, 2][: k + 1]), [None] * (k + 1))
    payload = {key: hidden_chunks if len(hidden_chunks) > 1 else hidden_chunks[0]}
    completion = SimpleNamespace(multimodal_output=payload if on_completion else None)
    return SimpleNamespace(request_id="x", stage_id=0, final_output_type="text", prompt_logprobs=flat,
                           outputs=[completion], multimodal_output=None if on_completion else payload)


def test_omni_hidden_states_from_chunked_multimodal_output():
    """Fake outputs: the chunk lists and both holders 0.30.0 may attach; the real server's
    hidden states (test_vllm_omni_real) arrive consolidated."""
    states = torch.randn(6, 4)
    out = stage_output(_fake_omni_output(list(range(6)), [states[:4], states[4:]]))
    torch.testing.assert_close(extract_hidden(out, 6), states)
    out = stage_output(_fake_omni_output(list(range(6)), [states], key="hidden", on_completion=False))
    torch.testing.assert_close(extract_hidden(out, 6), states)
    with pytest.raises(EngineError, match="shape"):
        extract_hidden(out, 7)
    with pytest.raises(EngineError, match="client output"):
        extract_hidden(SimpleNamespace(outputs=[], multimodal_output={}), 6)


async def test_omni_engine_scores_through_a_fake_async_omni():
    """Fake: it records the SamplingParams and request id proctor sends, which the real stage
    does not report back."""
    ids = [3, 9, 4, 5, 6]
    states = torch.randn(5, 4)

    class RecordingOmni:  # AsyncOmni.generate(prompt, request_id, sampling_params_list=[...])
        def __init__(self):
            self.calls = []

        async def generate(self, prompt, request_id, sampling_params_list=None):
            self.calls.append((prompt, request_id, sampling_params_list))
            yield _fake_omni_output(prompt["prompt_token_ids"], [states[:2], states[2:]])

    engine = VllmOmniEngine(_omni_spec())
    _faked_start(engine, RecordingOmni(), torch.bfloat16)
    (res,) = await engine.score([_request("o", ids, hidden=True)])
    assert res.logprobs.tolist() == [-2.0, -3.0, -4.0]
    assert res.topk_ids.tolist() == [[7, 8]] * 3
    assert res.hidden_states.dtype == torch.bfloat16
    torch.testing.assert_close(res.hidden_states, states[1:4].to(torch.bfloat16))
    prompt, rid, (params,) = engine._omni.calls[0]
    assert prompt == {"prompt_token_ids": ids}
    assert rid.startswith("o-") and params.prompt_logprobs == 2 and params.max_tokens == 1
    assert params.detokenize is False


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


async def test_omni_abort_stops_the_request_in_the_stage(model_dir):
    """Fake: a request must stay running to be aborted (the SLOW marker); the tiny Thinker
    answers in milliseconds."""
    engine = await _started(model_dir)
    try:
        slow = _request("slow", ids=(3, SLOW, 4))
        scoring = asyncio.create_task(engine.score([slow, _request("quick")]))
        await _until(lambda: slow.key in engine._engine_ids and bool(engine._omni.request_states))
        await engine.abort([slow.key])
        aborted, quick = await asyncio.wait_for(scoring, BOUND_S)
        assert isinstance(aborted, RequestAborted) and quick.logprobs is not None
        await _until(lambda: any(r.startswith("slow-") for r in engine._omni.stage_aborted))
        assert engine._engine_ids == {} and engine._running == {} and await engine.check_health()
    finally:
        await engine.close()


async def test_omni_cancelled_score_stops_the_request_in_the_stage(model_dir):
    """Fake: as the abort test (a request that stays running)."""
    engine = await _started(model_dir)
    try:
        scoring = asyncio.create_task(engine.score([_request("gone", ids=(3, SLOW, 4))]))
        await _until(lambda: bool(engine._omni.request_states))
        scoring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(scoring, BOUND_S)
        await _until(lambda: any(r.startswith("gone-") for r in engine._omni.stage_aborted))
        assert engine._engine_ids == {} and engine._running == {}
    finally:
        await engine.close()


async def test_omni_killed_stage_fails_inflight_requests_and_health(model_dir):
    """Fake: times the engine's own watcher (3 polls) on requests held running; the real
    SIGKILL under load is test_vllm_omni_real's."""
    engine = await _started(model_dir)
    try:
        assert engine._omni.stage_pid in engine._stage_procs  # the stage process is watched
        assert await engine.check_health()
        scoring = asyncio.create_task(engine.score([_request("a", ids=(3, SLOW, 4)), _request("b", ids=(5, SLOW))]))
        await _until(lambda: len(engine._omni.request_states) == 2)
        os.kill(engine._omni.stage_pid, signal.SIGKILL)
        started = time.monotonic()
        outcomes = await asyncio.wait_for(scoring, BOUND_S)
        assert time.monotonic() - started < 3 * omni_mod.STAGE_POLL_S + 1
        for outcome in outcomes:
            assert isinstance(outcome, EngineError)
            assert f"stage process {engine._omni.stage_pid} exited" in str(outcome)
        assert not await engine.check_health()
        with pytest.raises(EngineError, match="exited"):
            await engine.score([_request("c")])
    finally:
        await asyncio.wait_for(engine.close(), BOUND_S)


async def test_omni_startup_deadline_fails_with_the_log_tail(model_dir, monkeypatch):
    """Fake: a real stage cannot be made never to become ready on demand.
    A stage that never becomes ready under a vLLM-Omni whose start never returns."""
    monkeypatch.setattr(omni_mod, "STARTUP_GRACE_S", 0.2)
    engine = _FakedEngine(_omni_spec(model_dir, startup_timeout_s=1.0, max_model_len=64))
    engine.omni_cls = fake_omni(hang_init=True, stage_ready=False)
    before = len(FakeAsyncOmni.instances)
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"within 1s \(startup_timeout_s\)") as caught:
        await asyncio.wait_for(engine.start(), BOUND_S)
    assert time.monotonic() - started < 3
    assert "waiting for stage-0 to become ready" in str(caught.value)
    await _until(lambda: len(FakeAsyncOmni.instances) > before)
    stage = FakeAsyncOmni.instances[-1]._proc
    stage.join(timeout=BOUND_S)
    assert not stage.is_alive()  # the stage it spawned was killed, not left holding a device


async def test_omni_startup_passes_the_deadline_to_vllm_omni(model_dir, monkeypatch):
    """Fake: as the deadline test (a stage that never becomes ready)."""
    monkeypatch.setattr(omni_mod, "STARTUP_GRACE_S", 30.0)  # vLLM-Omni's own timeout must fire first
    engine = _FakedEngine(_omni_spec(model_dir, startup_timeout_s=1.0, max_model_len=64))
    engine.omni_cls = fake_omni(stage_ready=False)
    started = time.monotonic()
    with pytest.raises(EngineError, match="TimeoutError: Orchestrator did not become ready within 1s"):
        await asyncio.wait_for(engine.start(), BOUND_S)
    assert time.monotonic() - started < 5


async def test_omni_request_errors_are_the_requests_and_engine_errors_the_replicas(model_dir):
    """Fake: stage-reported 400s and engine errors cannot be provoked on demand in the real
    stage; too-long prompts and placeholder mismatches run for real in test_vllm_omni_real."""
    from PIL import Image

    engine = await _started(model_dir, fake_omni(stage_max_model_len=32))
    try:
        image = MultiModalInputs(images=(MediaItem(b"x", "image/png"),), decoded={"image": [Image.new("RGB", (2, 2))]})
        batch = [
            _request("good"),
            _request("long", ids=tuple(range(1, 41))),  # over the stage's max_model_len
            _request("placeholders", ids=(3, 4, 5), media=image),  # no IMAGE token for the image
            _request("stage400", ids=(3, CLIENT_ERROR, 4)),
            _request("topk", topk=17),  # over the teacher's 16
        ]
        good, long, placeholders, stage400, topk = await asyncio.wait_for(engine.score(batch), BOUND_S)
        assert good.logprobs is not None
        assert isinstance(long, RequestRejected) and long.field == "token_ids" and "maximum model length" in long.message
        assert isinstance(placeholders, RequestRejected) and placeholders.field == "images"
        assert isinstance(stage400, RequestRejected) and "audio" in stage400.message
        assert isinstance(topk, RequestRejected) and topk.field == "topk"
        assert await engine.check_health()
        ok, bad = await asyncio.wait_for(engine.score([_request("ok"), _request("bad", ids=(3, ENGINE_ERROR))]), BOUND_S)
        assert ok.logprobs is not None
        assert isinstance(bad, EngineError) and "EngineGenerateError: CUDA error" in str(bad)
    finally:
        await engine.close()


def test_omni_classification_of_0_18_runtime_errors():
    """Not run on the real 0.18.0: it is the Ascend image's pin (written against its wheel).
    0.18.0 raises RuntimeError(<orchestrator error dict>) for every stage error."""
    req = _request(media=MultiModalInputs(videos=(MediaItem(b"v", "video/mp4"),)))
    err = RuntimeError({"request_id": "r", "stage_id": 0, "error": "video frames could not be sampled"})
    rejected = classify_stage_error(err, req)
    assert isinstance(rejected, RequestRejected)
    assert rejected.field == "videos" and "frames" in rejected.message
    kwargs = RuntimeError({"request_id": "r", "stage_id": 0, "error": "got an unexpected keyword argument 'fsp'"})
    assert classify_stage_error(kwargs, req).field == "mm_processor_kwargs"
    nccl = classify_stage_error(RuntimeError({"request_id": "r", "error": "NCCL communicator aborted"}), req)
    # Not a known shape: a server fault of that request (retried once elsewhere; the replica's
    # probe after it, and the strike rule, decide whether the replica is unwell).
    assert isinstance(nccl, RequestFailed) and "NCCL" in nccl.cause
    dead = classify_stage_error(type("EngineDeadError", (RuntimeError,), {})("prompt too long"), req)
    assert isinstance(dead, EngineError)


def test_omni_fakes_match_the_real_library(tmp_path):
    """The fakes' config front door (omni_fakes.resolve_config, what FakeAsyncOmni accepts and
    how it sets up its stage) beside the real vLLM-Omni 0.30.0's on the same files, in .venv-omni:
    proctor's deploy config is accepted with the topology's "latent" output and the teacher's
    max_num_seqs and max_logprobs; the keys proctor wrote before, the legacy `stage_args` schema
    and `stage_configs_path` are refused with the same messages."""
    import subprocess

    import yaml

    from proctor.server.cli.tiny_multimodal import make_tiny_omni_thinker

    python = omni_python()
    model = make_tiny_omni_thinker(tmp_path / "thinker")
    spec = _omni_spec(model, max_num_seqs=48, max_model_len=512,
                      engine_kwargs={"vllm_omni": {"output_mode": "ar", "pipeline_name": "qwen2_5_omni"}})
    pipeline = PIPELINES["qwen2_5_omni"]
    written = deploy_config(spec, pipeline, 8)
    refused = {**written, "stages": [{**written["stages"][0], "engine_output_type": "latent",
                                      "disable_log_stats": True}]}
    files = {}
    for name, config in {"deploy": written, "refused": refused, "legacy": stage_config(spec, pipeline, 8)}.items():
        files[name] = tmp_path / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(config))
    cases = [("deploy_config", files["deploy"]), ("deploy_config", files["refused"]),
             ("deploy_config", files["legacy"]), ("stage_configs_path", files["deploy"])]
    script = ROOT_TESTS / "support" / "omni_config_check.py"
    run = subprocess.run([str(python), str(script), str(model), *[str(x) for case in cases for x in case]],
                         capture_output=True, text=True, timeout=300)
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")] or [run.stderr[-3000:]]
    real = json.loads(line.removeprefix("RESULT "))
    fake = [resolve_config(key, str(path)) for key, path in cases]
    assert fake == real
    assert real[0] == {"engine_output_type": "latent", "max_num_seqs": 48, "max_logprobs": 8}
    assert all("error" in outcome for outcome in real[1:])


def test_a_stale_egg_info_that_hides_the_hidden_state_plugin_stops_the_start(tmp_path):
    """Real metadata, real lookup: in a working folder holding an old `proctor.egg-info` (no
    `vllm_omni.general_plugins` entry), Python finds that one first and the stages would never
    load the plugin, so the engine refuses to start in one line; from a clean folder it passes."""
    import subprocess
    import sys

    stale = tmp_path / "stale" / "proctor.egg-info"
    stale.mkdir(parents=True)
    (stale / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: proctor\nVersion: 0.1.0\n")
    (stale / "entry_points.txt").write_text("[console_scripts]\nproctor = proctor.server.cli.main:main\n")
    check = ("from proctor.server.engines.vllm_omni import adapter\n"
             "try:\n    adapter.ask_for_hidden_states()\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n"
             "else:\n    print('registered')\n")
    (tmp_path / "clean").mkdir()
    runs = {where: subprocess.run([sys.executable, "-c", check], cwd=tmp_path / where, capture_output=True,
                                  text=True, timeout=120) for where in ("stale", "clean")}
    assert runs["clean"].stdout.strip() == "registered", runs["clean"].stderr
    refused = runs["stale"].stdout.strip()
    assert refused.startswith("EngineConfigError inference.name=vllm_omni: proctor's vLLM-Omni plugin"), refused
    assert "stale proctor.egg-info" in refused and "\n" not in refused
