"""One request can fail only itself: poison requests and out-of-memory batches on real replica workers.

The poison is real: an image with `mm_processor_kwargs={"patch_size": 7}` passes the processor
(it makes 7-px patches, and the token ids carry the placeholders for them) but the tiny
Qwen2-VL's vision tower, built for 14-px patches, raises a RuntimeError in its forward, inside
the replica worker's batch. Every replica is a real worker process (`WorkerClient`); the
out-of-memory is torch's own `OutOfMemoryError`, raised by the real torch engine for batches
above four requests (tests/support/faulty_engines.py), in its worker. After each fault, good
requests are answered exactly and the replica counts are read from /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
import numpy as np
import pytest
import torch

from proctor.client import TeacherClient
from proctor.client.transports import TeacherError
from proctor.server.config import single_teacher_router
from proctor.server.engines.base import EngineRequest, EngineSpec
from proctor.server.front.fleet.routing import ReplicaState
from proctor.server.front.runtime import ServerThread
from proctor.server.front.settings import ServerOptions

from support.multimodal import (
    Sample,
    assert_scores_match,
    noise_image,
    png,
    processor_of,
    reference,
    smooth_image,
)
from support.reference import reference_rows
from support.scoring import sequences
from support.servers import start_worker_server

TOPK = 4
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
POISON_KWARGS = {"patch_size": 7}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from proctor.server.cli.tiny_multimodal import make_tiny_vl_model

    return make_tiny_vl_model(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def vl_server(vl_dir):
    """A two-replica torch teacher, each replica in its own worker process."""
    spec = EngineSpec(name="torch", model_path=str(vl_dir), max_topk=16)
    server = ServerThread(single_teacher_router(spec, name="vl", replicas=2),
                          ServerOptions(grpc_port=0, http_port=0)).start()
    yield server
    server.stop()


def _metric(server: ServerThread, name: str) -> dict[str, float]:
    """Every series of `name` on /metrics: its labels → its value."""
    text = httpx.get(server.http_url + "/metrics", timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            found[labels] = float(value)
    return found


def _replica_counts(server: ServerThread) -> dict[str, float]:
    return {
        "failures": sum(_metric(server, "proctor:replica_failures_total").values()),
        "restarts": sum(_metric(server, "proctor:replica_restarts_total").values()),
        "faults": sum(_metric(server, "proctor:request_faults_total").values()),
        "poison": sum(_metric(server, "proctor:poison_requests_total").values()),
    }


def _worker_pids(server: ServerThread) -> list[int]:
    return [r.engine.pid for r in server.server.service.router.teachers["vl"].replicas]


def _good_samples(vl_dir) -> list[tuple[Sample, object]]:
    rng = np.random.default_rng(3)
    samples = [
        Sample(f"User: {IMAGE} what is this?", images=[png(noise_image(rng, 56, 56))]),
        Sample(f"User: {IMAGE} describe it.", images=[png(noise_image(rng, 56, 84))]),
        Sample(f"User: {IMAGE} and then?", images=[png(smooth_image(84, 56))]),
        Sample(f"User: {IMAGE} once more.", images=[png(noise_image(rng, 84, 84))]),
    ]
    return [(sample, reference(vl_dir, sample)) for sample in samples]


def _poison_ids(vl_dir, sample: Sample) -> list[int]:
    """The token ids the processor makes of the poison's text and image with its kwargs."""
    from support.multimodal import decode

    processor = processor_of(vl_dir)
    inputs = processor(text=[sample.text + " Fine."], images=[decode(sample.images[0], "images")],
                       return_tensors="pt", **POISON_KWARGS)
    return inputs["input_ids"][0].tolist()


def _text_ids(count: int, seed: int) -> list[list[int]]:
    return sequences(count, vocab=200, length=(12, 30), seed=seed)


def _text_refs(vl_dir, count: int):
    """Text-only sequences of the VL teacher and their references (the same forward, no media)."""
    words = ["what is 12 times 7?", "the quick brown fox", "pack my box", "teacher scores", "on-policy"]
    return [reference(vl_dir, Sample(f"User: {words[i % len(words)]} {i}")) for i in range(count)]


async def _good_calls(client: TeacherClient, goods, texts):
    images = [client.score(ref.ids, topk=TOPK, images=sample.images) for sample, ref in goods]
    plain = [client.score(ref.ids, topk=TOPK) for ref in texts]
    return images, plain


def _check_goods(vl_dir, goods, texts, image_answers, text_answers) -> None:
    for (_, ref), answer in zip(goods, image_answers, strict=True):
        assert_scores_match(answer, ref, topk=TOPK)
    for ref, answer in zip(texts, text_answers, strict=True):
        assert_scores_match(answer, ref, topk=TOPK)


async def test_a_poison_request_in_a_batch_of_eight_fails_alone_and_no_replica_is_marked(vl_server, vl_dir):
    rng = np.random.default_rng(11)
    poison = Sample(f"User: {IMAGE} what is this?", images=[png(noise_image(rng, 56, 56))])
    poison_ids = _poison_ids(vl_dir, poison)
    goods, texts = _good_samples(vl_dir), _text_refs(vl_dir, 3)
    before, pids = _replica_counts(vl_server), _worker_pids(vl_server)
    async with TeacherClient(f"grpc://{vl_server.grpc_target}") as client:
        images, plain = await _good_calls(client, goods, texts)
        bad = client.score(poison_ids, topk=TOPK, images=poison.images, mm_processor_kwargs=POISON_KWARGS)
        answers = await asyncio.gather(*images[:2], bad, *images[2:], *plain, return_exceptions=True)
        poisoned = answers.pop(2)
        assert isinstance(poisoned, TeacherError) and poisoned.code == "INTERNAL", poisoned
        assert "RuntimeError" in poisoned.message and "failed on replicas" in poisoned.message, poisoned.message
        _check_goods(vl_dir, goods, texts, answers[:4], answers[4:])
        # Later good requests: answered right, on replicas that never left the rotation.
        images, plain = await _good_calls(client, goods, texts)
        answers = await asyncio.gather(*images, *plain)
        _check_goods(vl_dir, goods, texts, answers[:4], answers[4:])
    after = _replica_counts(vl_server)
    assert after["failures"] == before["failures"] == 0 and after["restarts"] == 0
    assert after["faults"] - before["faults"] == 2  # tried on one replica, retried once on the other
    assert after["poison"] - before["poison"] == 1
    assert _worker_pids(vl_server) == pids
    assert all(r.state is ReplicaState.HEALTHY for r in vl_server.server.service.router.teachers["vl"].replicas)


async def test_the_batch_holding_a_poison_request_is_split_and_its_mates_answered(vl_server, vl_dir, caplog):
    """The isolation itself, deterministic: eight requests submitted in one loop turn reach a
    replica's batcher as one batch (the batcher runs after the submitting tasks)."""
    from proctor.server.engines.media import decode_media

    rng = np.random.default_rng(12)
    poison = Sample(f"User: {IMAGE} what is this?", images=[png(noise_image(rng, 56, 56))])
    client = TeacherClient(f"grpc://{vl_server.grpc_target}")  # only to build requests the wire's way
    from proctor.server.front.validation import validate

    teacher = vl_server.server.service.router.teachers["vl"]
    wire = [client.build_request(ref.ids, topk=TOPK) for ref in _text_refs(vl_dir, 7)]
    wire.insert(3, client.build_request(_poison_ids(vl_dir, poison), topk=TOPK, images=poison.images,
                                        mm_processor_kwargs=POISON_KWARGS))
    requests: list[EngineRequest] = []
    for message in wire:
        valid = validate(teacher, message, max_answer_bytes=None)
        request = valid.request
        if request.media:
            from dataclasses import replace

            request = replace(request, media=decode_media(request.media))
        requests.append(request)
    replica = teacher.replicas[0]

    async def one_batch():
        return await asyncio.gather(*(replica.score(r) for r in requests), return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="proctor.server.front.fleet.batch_isolation"):
        outcomes = vl_server.call(one_batch())
    assert "a batch of 8 requests failed" in caplog.text and "RuntimeError" in caplog.text
    failed = [i for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
    assert failed == [3], outcomes
    assert "the engine failed on this request" in str(outcomes[3])
    assert replica.state is ReplicaState.HEALTHY
    await client.close()


async def test_the_same_poison_request_twenty_times_is_retried_once_each_and_restarts_nothing(vl_server, vl_dir):
    rng = np.random.default_rng(13)
    poison = Sample(f"User: {IMAGE} look.", images=[png(noise_image(rng, 56, 56))])
    poison_ids = _poison_ids(vl_dir, poison)
    goods, texts = _good_samples(vl_dir), _text_refs(vl_dir, 4)
    before, pids = _replica_counts(vl_server), _worker_pids(vl_server)
    async with TeacherClient(f"grpc://{vl_server.grpc_target}") as client:
        bad = [client.score(poison_ids, topk=TOPK, images=poison.images, mm_processor_kwargs=POISON_KWARGS)
               for _ in range(20)]
        images, plain = await _good_calls(client, goods, texts)
        answers = await asyncio.gather(*bad, *images, *plain, return_exceptions=True)
        for error in answers[:20]:
            assert isinstance(error, TeacherError) and error.code == "INTERNAL", error
        _check_goods(vl_dir, goods, texts, answers[20:24], answers[24:])
        images, plain = await _good_calls(client, goods, texts)
        answers = await asyncio.gather(*images, *plain)
        _check_goods(vl_dir, goods, texts, answers[:4], answers[4:])
    after = _replica_counts(vl_server)
    assert after["faults"] - before["faults"] == 40  # each: one replica, then one retry: never a third
    assert after["poison"] - before["poison"] == 20
    assert after["failures"] == 0 and after["restarts"] == 0
    assert _worker_pids(vl_server) == pids


@pytest.fixture(scope="module")
def oom_server(tiny_model_dir):
    """One replica whose worker runs the real torch engine, out of memory above four requests."""
    from support.faulty_engines import build_out_of_memory_above_four

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=16)
    server = start_worker_server(spec, "oom", build_out_of_memory_above_four)
    yield server
    server.stop()


async def test_an_out_of_memory_batch_is_answered_in_smaller_batches(oom_server, tiny_model_dir, caplog):
    from proctor.server.front.validation import validate

    teacher = oom_server.server.service.router.teachers["oom"]
    texts = _text_ids(16, seed=21)
    client = TeacherClient(f"grpc://{oom_server.grpc_target}")
    requests = [validate(teacher, client.build_request(ids, topk=TOPK), max_answer_bytes=None).request for ids in texts]

    async def one_batch():  # sixteen in one loop turn: one batch of 16, which runs out of memory
        return await asyncio.gather(*(teacher.score(r) for r in requests), return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="proctor.server.front.fleet.batch_isolation"):
        outcomes = oom_server.call(one_batch())
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    assert re.search(r"a batch of 16 requests failed \(.*OutOfMemoryError", caplog.text), caplog.text
    assert re.search(r"a batch of 8 requests failed \(.*OutOfMemoryError", caplog.text), caplog.text
    # And through the wire, concurrently: every answer exact.
    answers = await asyncio.gather(*(client.score(ids, topk=TOPK) for ids in texts))
    for ids, answer in zip(texts, answers, strict=True):
        torch.testing.assert_close(answer.logprobs.double(), reference_rows(tiny_model_dir, ids).logprobs,
                                   atol=1e-4, rtol=0)
    await client.close()
    failures = _metric(oom_server, "proctor:replica_failures_total")
    assert failures and all(value == 0 for value in failures.values()), failures
    assert sum(_metric(oom_server, "proctor:request_faults_total").values()) == 0
    assert teacher.replicas[0].state is ReplicaState.HEALTHY
