"""Shared pieces of the client tests (no tests here): a float64 reference teacher, a
delaying engine that makes the real torch engine slow, and servers on fixed loopback ports."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import torch

from proctor.server.engines import EngineSpec, create_engine
from proctor.server.routing import Replica, Router, Teacher
from proctor.server.runtime import ServerOptions, ServerThread

from slow_engine import slow_router


class Reference:
    """The tiny teacher run directly in float64: log-probs, top-k and hidden states by row."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).double().eval()

    @torch.no_grad()
    def rows(self, ids: list[int], first_row: int = 1) -> dict[str, torch.Tensor]:
        tokens = torch.tensor([ids])
        hidden = self.model.get_decoder()(input_ids=tokens).last_hidden_state[0]
        logp = torch.log_softmax(self.model.get_output_embeddings()(hidden), dim=-1)
        rows = torch.arange(first_row, len(ids))
        return {
            "logprobs": logp[rows - 1, tokens[0, rows]],
            "logp": logp[rows - 1],
            "hidden": hidden[rows - 1],
        }


def delayed_router(model_dir: Path, delay: float, name: str = "slow") -> Router:
    """The real torch engine with `delay` seconds before each batch: a stand-in for a big
    teacher, so that deadlines and cancellation have time to act."""
    return slow_router(model_dir, delay, name=name)[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(router: Router, **options) -> ServerThread:
    options.setdefault("grpc_port", 0)
    options.setdefault("http_port", 0)
    return ServerThread(router, ServerOptions(**options)).start()


def request_count(server: ServerThread, outcome: str) -> float:
    """proctor:requests_total summed over teachers and modes for one outcome."""
    text = server.server.service.metrics.render().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("proctor:requests_total{") and f'outcome="{outcome}"' in line:
            total += float(re.split(r"\s+", line)[-1])
    return total


def engine_of(server: ServerThread, teacher: str):
    return server.server.service.router.teachers[teacher].replicas[0].engine


def two_teacher_router(math_dir: Path, geo_dir: Path) -> Router:
    """math (routing key openai/gsm8k) and geo (key hiyouga/geometry3k), one torch replica each."""

    def teacher(name: str, path: Path, key: str) -> Teacher:
        spec = EngineSpec(name="torch", model_path=str(path))

        async def build():
            return create_engine(spec)

        return Teacher(name, [Replica(f"{name}-0", build)], keys=(key,))

    return Router([teacher("math", math_dir, "openai/gsm8k"), teacher("geo", geo_dir, "hiyouga/geometry3k")])
