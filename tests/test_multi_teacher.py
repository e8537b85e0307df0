"""Several teachers behind one server: routing by key, and teachers sharing devices by swapping."""

from __future__ import annotations

import asyncio
import concurrent.futures

import grpc
import httpx
import pytest
import torch

from proctor.server.cli.tiny_model import make_tiny_model
from proctor.server.config import load_server_config
from proctor.server.engines.base import EngineRequest, EngineSpec
from proctor.server.engines.swap import SwapGroup
from proctor.server.front.runtime import ServerThread

from support.configs import cpu_config, torch_teacher, write_config
from support.reference import assert_matches_reference
from support.scoring import grpc_score, logprobs_of, sequences


@pytest.fixture(scope="module")
def twin_model_dir(tmp_path_factory):
    """Same architecture as the tiny teacher, other weights: it can share the tiny teacher's devices."""
    return make_tiny_model(tmp_path_factory.mktemp("twin-teacher"), seed=2)


def _serve(tmp_path, teachers: dict, devices: int) -> ServerThread:
    router, options = load_server_config(write_config(tmp_path, cpu_config(teachers, devices=devices)))
    return ServerThread(router, options).start()


@pytest.fixture(scope="module")
def two_teacher_server(tmp_path_factory, tiny_model_dir, other_model_dir):
    teachers = {"math": torch_teacher(tiny_model_dir, key="math/gsm8k"), "code": torch_teacher(other_model_dir, key="code")}
    server = _serve(tmp_path_factory.mktemp("cfg"), teachers, devices=2)
    yield server
    server.stop()


@pytest.mark.parametrize(("key", "model"), [("math/gsm8k", "tiny"), ("code", "other")])
def test_each_key_is_scored_by_its_own_teacher(two_teacher_server, key, model, tiny_model_dir, other_model_dir):
    model_dir = {"tiny": tiny_model_dir, "other": other_model_dir}[model]
    for ids in sequences(4, seed=hash(key) % 1000):
        response = grpc_score(two_teacher_server.grpc_target, ids, teacher_key=key)
        assert_matches_reference(logprobs_of(response), model_dir, ids, atol=1e-5)


def test_the_two_teachers_really_differ(two_teacher_server):
    ids = sequences(1, seed=7)[0]
    a = logprobs_of(grpc_score(two_teacher_server.grpc_target, ids, teacher_key="math/gsm8k"))
    b = logprobs_of(grpc_score(two_teacher_server.grpc_target, ids, teacher_key="code"))
    assert (a - b).abs().max() > 1e-2


def test_unknown_key_is_not_found_on_grpc_and_http(two_teacher_server):
    with pytest.raises(grpc.RpcError) as err:
        grpc_score(two_teacher_server.grpc_target, [1, 2, 3], teacher_key="biology")
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and "biology" in err.value.details()
    body = {"teacher_key": "biology", "token_ids": [1, 2, 3], "logprobs": True}
    response = httpx.post(f"{two_teacher_server.http_url}/v1/score", json=body)
    assert response.status_code == 404 and response.json()["error"]["field"] == "teacher_key"


def test_missing_key_is_refused_with_several_teachers_never_defaulted(two_teacher_server):
    with pytest.raises(grpc.RpcError) as err:
        grpc_score(two_teacher_server.grpc_target, [1, 2, 3])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "math/gsm8k" in err.value.details() and "code" in err.value.details()
    response = httpx.post(f"{two_teacher_server.http_url}/v1/score", json={"token_ids": [1, 2, 3], "logprobs": True})
    assert response.status_code == 422


def test_teachers_are_listed_with_their_keys_and_replicas(two_teacher_server):
    listing = httpx.get(f"{two_teacher_server.http_url}/v1/teachers").json()
    teachers = {t["name"]: t for t in listing["teachers"]}
    assert teachers["math"]["keys"] == ["math/gsm8k"] and teachers["code"]["keys"] == ["code"]
    assert [r["devices"] for r in teachers["code"]["replicas"]] == [["1"]]


# -- sharing devices ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, tiny_model_dir, twin_model_dir):
    """Two teachers of one architecture, one device: they share it by swapping weights."""
    teachers = {
        "math": torch_teacher(tiny_model_dir, key="math", num_replicas=None),
        "code": torch_teacher(twin_model_dir, key="code", num_replicas=None),
    }
    server = _serve(tmp_path_factory.mktemp("cfg"), teachers, devices=1)
    yield server
    server.stop()


def _swaps(server: ServerThread) -> dict[str, float]:
    text = httpx.get(f"{server.http_url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("proctor:teacher_swaps_total{"):
            teacher = line.split('teacher="')[1].split('"')[0]
            out[teacher] = float(line.rsplit(" ", 1)[1])
    return out


def test_swapped_in_teacher_scores_like_a_resident_one(shared_server, tiny_model_dir, twin_model_dir):
    router = shared_server.server.service.router
    group = router.teachers["math"].swap_groups[0]
    assert group.resident == "math"
    ids = sequences(1, seed=11)[0]
    resident = logprobs_of(grpc_score(shared_server.grpc_target, ids, teacher_key="math"))
    swapped_in = logprobs_of(grpc_score(shared_server.grpc_target, ids, teacher_key="code"))
    assert group.resident == "code"
    back = logprobs_of(grpc_score(shared_server.grpc_target, ids, teacher_key="math"))
    assert_matches_reference(resident, tiny_model_dir, ids, atol=1e-5)
    assert_matches_reference(swapped_in, twin_model_dir, ids, atol=1e-5)
    torch.testing.assert_close(back, resident, rtol=0, atol=0)
    swaps = _swaps(shared_server)
    assert swaps["code"] >= 1 and swaps["math"] >= 1


def test_interleaved_load_on_shared_teachers_is_answered_with_few_swaps(shared_server, tiny_model_dir, twin_model_dir):
    before = _swaps(shared_server)
    work = [("math" if i % 2 else "code", ids) for i, ids in enumerate(sequences(24, seed=5))]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda kw: grpc_score(shared_server.grpc_target, kw[1], teacher_key=kw[0]), work))
    for (key, ids), response in zip(work, answers, strict=True):
        model = tiny_model_dir if key == "math" else twin_model_dir
        assert_matches_reference(logprobs_of(response), model, ids, atol=1e-5)
    after = _swaps(shared_server)
    swaps = sum(after.values()) - sum(before.values())
    assert swaps <= 12, f"{swaps} swaps for 24 alternating requests: batching per teacher is not working"


# -- the swap scheduler ---------------------------------------------------------------------


def _request(i: int) -> EngineRequest:
    ids = torch.tensor(sequences(1, seed=100 + i)[0])
    return EngineRequest(f"r{i}", ids, 1, logprobs=True, topk=0, hidden_states=False)


async def _group(tiny_model_dir, twin_model_dir, max_consecutive: int) -> SwapGroup:
    specs = {
        "a": EngineSpec("torch", str(tiny_model_dir), dtype="float32"),
        "b": EngineSpec("torch", str(twin_model_dir), dtype="float32"),
    }
    group = SwapGroup("g", specs, max_consecutive_batches=max_consecutive)
    await group.acquire()
    return group


async def test_scheduler_drains_the_resident_teacher_before_swapping(tiny_model_dir, twin_model_dir):
    group = await _group(tiny_model_dir, twin_model_dir, max_consecutive=8)
    try:
        jobs = [group.score(t, [_request(i)]) for i, t in enumerate("ababab")]
        await asyncio.gather(*jobs)
        assert group.batches_run == list("aaabbb")
        assert group.swaps == {"a": 0, "b": 1}
    finally:
        await group.release()


async def test_scheduler_bounds_a_busy_teacher_so_others_do_not_starve(tiny_model_dir, twin_model_dir):
    group = await _group(tiny_model_dir, twin_model_dir, max_consecutive=3)
    try:
        jobs = [group.score("a", [_request(i)]) for i in range(8)] + [group.score("b", [_request(99)])]
        await asyncio.gather(*jobs)
        assert group.batches_run.index("b") == 3
        assert group.batches_run.count("a") == 8
    finally:
        await group.release()


async def test_teachers_of_different_shapes_cannot_share_a_group(tiny_model_dir, other_model_dir):
    specs = {"a": EngineSpec("torch", str(tiny_model_dir)), "b": EngineSpec("torch", str(other_model_dir))}
    group = SwapGroup("g", specs)
    with pytest.raises(Exception, match="different weight shapes"):
        await group.acquire()
