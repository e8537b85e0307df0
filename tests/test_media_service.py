"""Media through the real servers: decoded and bounded by the service before admission, then
handed to an engine that takes media; bad media is the request's 422, never a replica's fault."""

from __future__ import annotations

import base64
import io
import wave

import grpc
import httpx
import numpy as np
import pytest

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import decode_tensor
from proctor.server.engines.base import EngineSpec
from proctor.server.engines.media import MediaLimits
from proctor.server.front.fleet.routing import Replica, ReplicaSet, Router
from proctor.server.front.service import Limits

from support.engines import MediaTakingEngine
from support.reference import assert_matches_reference
from support.servers import start_server


def _png(size=(8, 6)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _wav(seconds: float = 0.25, rate: int = 8000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes((np.sin(np.arange(int(seconds * rate)) / 5) * 9000).astype("<i2").tobytes())
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def media_server(tiny_model_dir):
    engines: list[MediaTakingEngine] = []

    async def build():
        engines.append(MediaTakingEngine(EngineSpec(name="torch", model_path=str(tiny_model_dir))))
        return engines[-1]

    replica = Replica("omni-0", build)
    router = Router([ReplicaSet("omni", [replica])])
    limits = Limits(media=MediaLimits(max_image_pixels=100 * 100, max_video_frames=8))
    server = start_server(router, limits=limits)
    server.engines, server.replica = engines, replica
    yield server
    server.stop()


IDS = [5, 17, 33, 2, 90, 41, 7, 8, 9, 10]


def test_media_reaches_the_engine_decoded_and_the_scores_are_exact(media_server, tiny_model_dir):
    frames = np.zeros((3, 4, 4, 3), dtype=np.uint8)
    waveform = np.linspace(-0.5, 0.5, 1200, dtype=np.float32)
    request = scoring_pb2.ScoreRequest(
        token_ids=IDS, logprobs=True,
        images=[scoring_pb2.Media(data=_png(), media_type="image/png"),
                scoring_pb2.Media(data=_png((5, 5)), media_type="image/png")],
        audios=[scoring_pb2.Media(data=_wav(), media_type="audio/wav"),
                scoring_pb2.Media(data=_npy(waveform), media_type="application/x-npy; rate=24000")],
        videos=[scoring_pb2.Media(data=_npy(frames), media_type="video/x-npy")],
    )
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(media_server.grpc_target))
    answer = stub.Score(request, timeout=60)
    assert_matches_reference(decode_tensor(answer.logprobs), tiny_model_dir, IDS, atol=1e-5)
    received = media_server.engines[0].received[-1]
    assert [image.size for image in received["image"]] == [(8, 6), (5, 5)]
    (wav, wav_rate), (npy, npy_rate) = received["audio"]
    assert (wav.shape, wav_rate) == ((2000,), 8000)
    assert npy_rate == 24000 and np.array_equal(npy, waveform)  # the rate travels with the waveform
    assert received["video"][0].shape == (3, 4, 4, 3)


@pytest.mark.parametrize(
    ("field", "item", "message"),
    [
        ("images", {"data": base64.b64encode(b"\x89PNG not really").decode(), "media_type": "image/png"}, "cannot decode"),
        ("images", {"data": base64.b64encode(_png((200, 200))).decode(), "media_type": "image/png"}, "exceed the limit"),
        ("audios", {"data": base64.b64encode(b"RIFF....WAVE").decode(), "media_type": "audio/wav"}, "cannot decode"),
        ("audios", {"data": base64.b64encode(_npy(np.array(["a"]))).decode(), "media_type": "application/x-npy"}, "numeric"),
        ("videos", {"data": base64.b64encode(_npy(np.zeros((9, 2, 2, 3), np.uint8))).decode(),
                    "media_type": "video/x-npy"}, "exceed the limit"),
    ],
)
def test_bad_media_is_the_requests_422_and_never_reaches_the_replica(media_server, field, item, message):
    scored_before = len(media_server.engines[0].received)
    answer = httpx.post(media_server.http_url + "/v1/score", json={"token_ids": IDS, field: [item]}, timeout=30)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == field and error["message"].startswith(f"{field}[0]:") and message in error["message"]
    assert len(media_server.engines[0].received) == scored_before  # the engine never saw it
    assert media_server.replica.failures == 0 and media_server.replica.restarts == 0
    ok = httpx.post(media_server.http_url + "/v1/score", json={"token_ids": IDS}, timeout=30)
    assert ok.status_code == 200


def test_bad_media_over_grpc_is_invalid_argument(media_server):
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(media_server.grpc_target))
    request = scoring_pb2.ScoreRequest(
        token_ids=IDS, logprobs=True, images=[scoring_pb2.Media(data=b"GIF89a broken", media_type="image/gif")]
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("images[0]:")
    assert media_server.replica.failures == 0
