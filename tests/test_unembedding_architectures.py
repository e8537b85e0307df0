"""The unembedding of any architecture is the model's own output embedding.

A tiny GPT-2 (random weights, built locally) names its weights its own way: its head is
`lm_head` tied to `transformer.wte`, and the checkpoint holds only `transformer.wte.weight`.
Served by the torch engine in its replica worker, `/v1/unembedding` (HTTP) and GetUnembedding
(gRPC) must equal what transformers' own `get_output_embeddings()` holds for that checkpoint,
and scoring must match transformers' forward. The vLLM engines read the checkpoint by the same
names (`checkpoint.load_unembedding`), checked here without starting one.
"""

from __future__ import annotations

import pytest
import torch

from proctor.client import TeacherClient
from proctor.server.config import single_teacher_router
from proctor.server.engines.base import EngineSpec
from proctor.server.engines.checkpoint import load_unembedding, own_output_embedding_names
from proctor.server.front.runtime import ServerThread
from proctor.server.front.settings import ServerOptions

from support.reference import reference_rows


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gpt2"), family="gpt2")


@pytest.fixture(scope="module")
def gpt2_server(gpt2_dir):
    spec = EngineSpec(name="torch", model_path=str(gpt2_dir), max_topk=8)
    server = ServerThread(single_teacher_router(spec, name="gpt2"), ServerOptions(grpc_port=0, http_port=0)).start()
    yield server
    server.stop()


def _own_output_embedding(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.get_output_embeddings().weight.detach().clone()


def test_the_checkpoint_holds_no_lm_head(gpt2_dir):
    from safetensors import safe_open

    with safe_open(str(gpt2_dir / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names


@pytest.mark.parametrize("scheme", ["grpc", "http"])
async def test_a_gpt2_teacher_serves_its_own_output_embedding(gpt2_server, gpt2_dir, scheme):
    target = f"grpc://{gpt2_server.grpc_target}" if scheme == "grpc" else gpt2_server.http_url
    async with TeacherClient(target) as client:
        weight = await client.unembedding()
        ids = [5, 17, 33, 2, 90, 41, 7, 120, 64]
        scores = await client.score(ids)
    want = _own_output_embedding(gpt2_dir)
    assert weight.shape == want.shape == (512, 64)
    torch.testing.assert_close(weight.float(), want, atol=0, rtol=0)
    torch.testing.assert_close(scores.logprobs.double(), reference_rows(gpt2_dir, ids).logprobs, atol=1e-4, rtol=0)


def test_the_vllm_engines_read_the_same_weight_from_the_checkpoint(gpt2_dir, tiny_model_dir):
    assert "transformer.wte.weight" in own_output_embedding_names(str(gpt2_dir))
    torch.testing.assert_close(load_unembedding(gpt2_dir), _own_output_embedding(gpt2_dir), atol=0, rtol=0)
    torch.testing.assert_close(load_unembedding(tiny_model_dir), _own_output_embedding(tiny_model_dir),
                               atol=0, rtol=0)
