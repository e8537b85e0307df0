"""Helpers shared by the routing, failover, multi-teacher and Ray suites.

A float32 transformers forward as the reference for every score, blocking gRPC calls to a
real server on loopback, and config files written from dicts.
"""

from __future__ import annotations

import functools
from pathlib import Path

import grpc
import torch
import yaml

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import decode_tensor
from proctor.server.engines import EngineSpec


@functools.cache
def _reference_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()


def reference_logprobs(model_dir: Path | str, ids: list[int], first_row: int = 1) -> torch.Tensor:
    """log p(token i | tokens < i) for rows first_row..T-1, from the model's own forward pass."""
    model = _reference_model(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[:-1]  # position i-1 predicts token i
    rows = logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return rows[first_row - 1 :]


def sequences(count: int, *, vocab: int = 512, length: tuple[int, int] = (6, 40), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(length[0], length[1], (1,), generator=g))
        out.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    return out


@functools.cache
def _stub(target: str) -> scoring_pb2_grpc.TeacherScoringStub:
    return scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(target))


def grpc_score(target: str, ids: list[int], *, teacher_key: str = "", request_id: str = "", topk: int = 0,
               timeout: float = 60) -> scoring_pb2.ScoreResponse:
    request = scoring_pb2.ScoreRequest(
        request_id=request_id, teacher_key=teacher_key, token_ids=ids, logprobs=True, topk=topk
    )
    return _stub(target).Score(request, timeout=timeout)


def logprobs_of(response: scoring_pb2.ScoreResponse) -> torch.Tensor:
    return decode_tensor(response.logprobs).clone()


def write_config(tmp_path: Path, document: dict, name: str = "proctor.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def torch_teacher(model_dir: Path | str, *, key: str | None = None, num_replicas: int | None = 1) -> dict:
    """A verl teacher_models entry for the torch engine on one CPU 'device' per replica."""
    entry: dict = {
        "model_path": str(model_dir),
        "inference": {"name": "torch", "tensor_model_parallel_size": 1, "dtype": "float32",
                      "prompt_length": 64, "response_length": 64, "max_model_len": 256},
    }
    if key is not None:
        entry["key"] = key
    if num_replicas is not None:
        entry["num_replicas"] = num_replicas
    return entry


def cpu_config(teachers: dict, *, devices: int, server: dict | None = None) -> dict:
    return {
        "distillation": {
            "enabled": True,
            "nnodes": 1,
            "n_gpus_per_node": devices,
            "teacher_key": "data_source",
            "teacher_models": teachers,
            "distillation_loss": {"loss_mode": "forward_kl_topk", "topk": 8},
        },
        "server": {"device": "cpu", "grpc_port": 0, "http_port": 0, "health_check_interval_s": 0.5,
                   "restart_initial_backoff_s": 0.1, **(server or {})},
    }


class InjectedReplicas:
    """A teacher whose replicas are real torch engines wrapped in `InjectedEngine`.

    `engines[i]` is replica i's current engine (a restart builds a new one); `fail_restarts`
    makes restarts fail until cleared.
    """

    def __init__(self, model_dir, *, delays: list[float], policy: str = "least_outstanding",
                 health_check_interval_s: float | None = None) -> None:
        from proctor.server.chaos import InjectedEngine
        from proctor.server.engines import create_engine
        from proctor.server.routing import Replica, RestartPolicy, Router, Teacher

        self.engines: list[InjectedEngine | None] = [None] * len(delays)
        self.built = [0] * len(delays)
        self.fail_restarts = False
        spec = EngineSpec("torch", str(model_dir), dtype="float32")

        def factory(i: int):
            async def build():
                if self.fail_restarts and self.built[i]:
                    raise RuntimeError("injected: replica cannot come back yet")
                self.built[i] += 1
                self.engines[i] = InjectedEngine(create_engine(spec), delay_per_token_s=delays[i])
                return self.engines[i]

            return build

        self.replicas = [Replica(f"r{i}", factory(i)) for i in range(len(delays))]
        self.teacher = Teacher("t", self.replicas, policy=policy, health_check_interval_s=health_check_interval_s,
                               restart=RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2))
        self.router = Router([self.teacher])

    def serve(self):
        from proctor.server.runtime import ServerOptions, ServerThread

        return ServerThread(self.router, ServerOptions(grpc_port=0, http_port=0)).start()


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)
