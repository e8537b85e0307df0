"""A teacher moved to another step while it serves (`POST /admin/teachers/{name}/checkpoint`),
through a real server: the torch engine, 2 replicas (each in its replica worker), a load of
concurrent gRPC requests during the move. None is lost, each answer carries the fingerprint of
the step that scored it and equals that step's float64 reference; a step that fails to load
leaves the old one serving, and the call says why. (A Megatron step, converted by the move:
tests/test_megatron_checkpoint.py.)"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.server.engines.fingerprint import model_fingerprint

from support.configs import cpu_config, torch_teacher, write_config
from support.reference import reference_rows

TOKEN = "move-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WORK = [[1, 17, 42, 99, 7, 250, 3, 64], [5, 9, 200, 31, 77, 2], [128, 64, 32, 16, 8, 4, 2, 1, 0, 11]]


@pytest.fixture(scope="module")
def step_b(tmp_path_factory) -> Path:
    """The next step: the tiny teacher's architecture and tokenizer, other weights."""
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("step-b"), seed=7)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    """One teacher of 2 replicas on the tiny teacher's weights (step A), behind a bearer token."""
    from proctor.server.config import load_server_config
    from proctor.server.front.runtime import ServerThread

    root = tmp_path_factory.mktemp("move-cfg")
    (root / "token").write_text(TOKEN)
    config = write_config(root, cpu_config({"tiny": torch_teacher(tiny_model_dir, num_replicas=2)}, devices=2,
                                           server={"auth_token_file": str(root / "token")}))
    server = ServerThread(*load_server_config(config)).start()
    yield server
    server.stop()


def _admin(server, body: dict, *, name: str = "tiny", headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.http_url}/admin/teachers/{name}/checkpoint", json=body,
                      headers=AUTH if headers is None else headers, timeout=120)


def _teacher(stub) -> scoring_pb2.TeacherInfo:
    (info,) = stub.ListTeachers(scoring_pb2.TeachersRequest(), metadata=tuple(AUTH.items())).teachers
    return info


def _check_answers(answers: list[tuple[int, scoring_pb2.ScoreResponse]], steps: dict[str, Path]) -> dict[str, int]:
    """Each answer equals the float64 reference of the step its fingerprint names; answers per step."""
    references = {fp: [reference_rows(folder, ids).logprobs for ids in WORK] for fp, folder in steps.items()}
    seen = dict.fromkeys(steps, 0)
    for index, response in answers:
        assert response.fingerprint in steps, response.fingerprint
        got = torch.frombuffer(bytearray(response.logprobs.data), dtype=torch.float32).double()
        assert (got - references[response.fingerprint][index]).abs().max() < 1e-4, (index, response.fingerprint)
        seen[response.fingerprint] += 1
    return seen


def test_a_teacher_moves_to_another_step_under_load_and_no_request_is_lost(server, tiny_model_dir, step_b):
    old, new = model_fingerprint(tiny_model_dir), model_fingerprint(step_b)
    channel = grpc.insecure_channel(server.grpc_target)
    stub = scoring_pb2_grpc.TeacherScoringStub(channel)
    assert {r.fingerprint for r in _teacher(stub).replicas} == {old}
    answers: list[tuple[int, scoring_pb2.ScoreResponse]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def load(worker: int) -> None:
        count = 0
        while not done.is_set():
            index = (worker + count) % len(WORK)
            count += 1
            try:
                response = stub.Score(scoring_pb2.ScoreRequest(request_id=f"w{worker}-{count}", token_ids=WORK[index],
                                                               logprobs=True), metadata=tuple(AUTH.items()), timeout=60)
            except BaseException as exc:  # every failure is a lost request: collected, asserted
                errors.append(exc)
                continue
            answers.append((index, response))
            time.sleep(0.005)  # a steady load, not one that starves the replicas' restarts of CPU

    threads = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        moved = _admin(server, {"model_path": str(step_b)})
        after_move = len(answers)
        time.sleep(0.5)
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert moved.status_code == 200, moved.text
    report = moved.json()
    assert (report["fingerprint"], report["previous"], report["replicas"]) == (new, old, ["tiny-0", "tiny-1"])
    assert errors == []
    seen = _check_answers(answers, {old: tiny_model_dir, new: step_b})
    assert seen[old] > 0 and seen[new] > 0 and len(answers) > after_move
    assert all(r.fingerprint == new for _, r in answers[after_move:])  # once moved, the new step only
    info = _teacher(stub)
    assert info.fingerprint == new
    assert [(r.fingerprint, r.state) for r in info.replicas] == [(new, scoring_pb2.HEALTHY)] * 2
    print(f"move: {report['move_s']:.1f} s for 2 replicas; {len(answers)} answers ({seen}), 0 lost")
    channel.close()


def test_a_step_that_does_not_load_leaves_the_old_one_serving_and_says_why(server, tmp_path, tiny_model_dir, step_b):
    channel = grpc.insecure_channel(server.grpc_target)
    stub = scoring_pb2_grpc.TeacherScoringStub(channel)
    serving = _teacher(stub).fingerprint
    missing = _admin(server, {"model_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 422 and missing.json()["error"]["field"] == "model_path", missing.text
    broken = tmp_path / "broken-step"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)  # a step whose weights are unreadable
    refused = _admin(server, {"model_path": str(broken)})
    assert refused.status_code == 500, refused.text
    message = refused.json()["error"]["message"]
    assert "did not load on replica tiny-0" in message and f"still serves {serving}" in message
    info = _teacher(stub)
    assert info.fingerprint == serving
    assert [(r.fingerprint, r.state) for r in info.replicas] == [(serving, scoring_pb2.HEALTHY)] * 2
    answers = [(i, stub.Score(scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, replica=replica),
                              metadata=tuple(AUTH.items()), timeout=60))
               for i, ids in enumerate(WORK) for replica in ("tiny-0", "tiny-1")]
    folder = step_b if serving == model_fingerprint(step_b) else tiny_model_dir
    assert _check_answers(answers, {serving: folder}) == {serving: 6}
    assert _admin(server, {"model_path": str(step_b)}, headers={}).status_code == 401
    assert _admin(server, {"model_path": str(step_b)}, name="nobody").status_code == 404
    both = _admin(server, {"model_path": str(step_b), "dist_ckpt_path": str(tmp_path)})
    assert both.status_code == 422 and "exactly one" in both.json()["error"]["message"]
    channel.close()
