"""Hidden states larger than one comfortable message travel through ScoreStream in whole rows."""

from __future__ import annotations

import grpc
import pytest
import torch

from proctor.proto import decode_tensor, scoring_pb2, scoring_pb2_grpc

from support.reference import reference_rows


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory):
    """A teacher with hidden size 2048: 8 KiB of float32 per row."""
    from proctor.server.cli.tiny_model import make_tiny_model
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions

    path = make_tiny_model(tmp_path_factory.mktemp("wide"), hidden_size=2048, num_layers=1, num_heads=16,
                           num_kv_heads=4, intermediate_size=256, vocab_size=300)
    spec = EngineSpec(name="torch", model_path=str(path))
    server = ServerThread(single_teacher_router(spec), ServerOptions(grpc_port=0, http_port=0, stream_chunk_bytes=1 << 20))
    server.start()
    yield server, path
    server.stop()


def test_hidden_states_over_8_mib_arrive_whole_through_the_stream(wide_server):
    server, path = wide_server
    ids = [i % 300 for i in range(1100)]  # 1099 rows x 2048 x 4 bytes = 8.6 MiB
    request = scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=1, logprobs=True, hidden_states=True)
    with grpc.insecure_channel(server.grpc_target, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = scoring_pb2_grpc.TeacherScoringStub(channel)
        chunks = list(stub.ScoreStream(request))
        unary = stub.Score(request)
    assert len(chunks) > 8 and chunks[-1].last and not any(c.last for c in chunks[:-1])
    assert all(c.ByteSize() < 2 << 20 for c in chunks), "a chunk exceeded its size target"
    pieces = [c.response.hidden_states for c in chunks if c.response.HasField("hidden_states")]
    assert [p.first_row for p in pieces] == sorted(p.first_row for p in pieces)
    hidden = torch.cat([decode_tensor(p) for p in pieces])
    assert hidden.numel() * 4 > 8 << 20
    assert b"".join(p.data for p in pieces) == unary.hidden_states.data  # bit-exact reassembly
    ref = reference_rows(path, ids)
    torch.testing.assert_close(hidden, ref.hidden_states, atol=1e-5, rtol=0)
    # Log-probs against the float64 forward: at hidden 2048 a float32 forward is itself ~2e-4 from it,
    # and the engine's lm_head (row chunks of 1024) rounds differently from the reference's one
    # matmul by ~1e-5, so the bound is the float32 reference's own error (+10%), not a fixed 1e-5.
    exact = reference_rows(path, ids, dtype=torch.float64).logprobs
    float32_error = float((ref.logprobs - exact).abs().max())
    got = decode_tensor(chunks[0].response.logprobs).double()
    assert float((got - exact).abs().max()) <= 1.1 * float32_error
