"""Hidden states in a compressed wire form, end to end on a real server (torch engine, both
transports, unary and streamed), checked against the exact hidden states compressed by the same
rule here; the forms a teacher cannot give are refused naming the field; the default stays exact."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
import torch

from proctor.client import TeacherClient
from proctor.proto import decode_tensor, hidden_forms, scoring_pb2, scoring_pb2_grpc
from proctor.server.engines.hidden_forms import compress, projection_of

RANK = 8  # H/8 of the tiny teacher (H = 64)
IDS = [5, 17, 99, 3, 250, 31, 64, 7, 400, 12, 8, 77, 300, 2]


@pytest.fixture(scope="module")
def projected_server(tiny_model_dir):
    """The tiny teacher with a hidden-state projection of rank H/8."""
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir), inference={"hidden_projection_rank": RANK})
    # Small stream chunks: a streamed answer of a few rows comes in several pieces.
    server = ServerThread(single_teacher_router(spec, name="tiny"),
                          ServerOptions(grpc_port=0, http_port=0, stream_chunk_bytes=40))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def unembedding(tiny_model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).get_output_embeddings().weight.detach().float()


def _stub(server) -> scoring_pb2_grpc.TeacherScoringStub:
    return scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))


def _request(form: str, ids=IDS) -> scoring_pb2.ScoreRequest:
    return scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=3, logprobs=True, hidden_states=True, hidden_form=form)


def _expected(exact: torch.Tensor, form: str, unembedding: torch.Tensor) -> torch.Tensor:
    return compress(exact, form, projection_of(unembedding, RANK).matrix)


def test_list_teachers_states_the_forms_and_the_projections_captured_energy(projected_server, unembedding):
    (info,) = _stub(projected_server).ListTeachers(scoring_pb2.TeachersRequest()).teachers
    assert tuple(info.hidden_forms) == hidden_forms.FORMS and info.projection_rank == RANK
    assert info.projection_energy == pytest.approx(projection_of(unembedding, RANK).energy, rel=1e-9)
    body = httpx.get(projected_server.http_url + "/v1/teachers", timeout=30).json()["teachers"][0]
    assert body["hidden_forms"] == list(hidden_forms.FORMS) and body["projection_rank"] == RANK


@pytest.mark.parametrize("form", hidden_forms.FORMS)
def test_each_form_over_grpc_unary_and_stream_is_the_exact_state_compressed(projected_server, unembedding, form):
    stub = _stub(projected_server)
    exact = decode_tensor(stub.Score(_request("")).hidden_states)
    assert exact.dtype == torch.float32 and exact.shape == (len(IDS) - 3, 64)
    unary = stub.Score(_request(form)).hidden_states
    chunks = list(stub.ScoreStream(_request(form)))
    pieces = [c.response.hidden_states for c in chunks if c.response.HasField("hidden_states")]
    assert len(pieces) > 1, "the stream should carry several row chunks"
    assert b"".join(p.data for p in pieces) == unary.data
    got = decode_tensor(unary)
    want = _expected(exact, form, unembedding)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)  # the same rule on the same rows: bit-equal
    rank, h = RANK, 64
    assert len(unary.data) // got.shape[0] == hidden_forms.row_bytes(form, h, rank, 4)


@pytest.mark.parametrize("form", ["fp8", "projected_fp8"])
@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_the_client_gets_each_form_over_both_transports(projected_server, unembedding, form, transport):
    target = f"grpc://{projected_server.grpc_target}" if transport == "grpc" else projected_server.http_url

    async def run():
        async with TeacherClient(target) as client:
            exact = await client.score(IDS, prompt_length=3, hidden_states=True)
            compressed = await client.score(IDS, prompt_length=3, hidden_states=True, hidden_form=form)
            streamed = await client.stream_hidden_states(IDS, prompt_length=3, hidden_form=form)
            weight = await client.unembedding(projected=form in hidden_forms.PROJECTED_FORMS)
            return exact, compressed, streamed, weight

    exact, compressed, streamed, weight = asyncio.run(run())
    assert exact.hidden_states.dtype == torch.float32  # the default stays exact
    want = _expected(exact.hidden_states, form, unembedding)
    assert torch.equal(compressed.hidden_states, want) and torch.equal(streamed.hidden_states, want)
    if form == "projected_fp8":
        torch.testing.assert_close(weight, unembedding @ projection_of(unembedding, RANK).matrix, atol=1e-6, rtol=0)
    else:
        assert torch.equal(weight, unembedding)


def test_http_json_answers_carry_the_packed_rows(projected_server):
    body = httpx.post(projected_server.http_url + "/v1/score", timeout=30,
                      json={"token_ids": IDS, "prompt_length": 3, "hidden_states": True, "hidden_form": "fp8"}).json()
    assert body["hidden_states"]["dtype"] == "float8_e4m3_rows"
    assert body["hidden_states"]["shape"] == [len(IDS) - 3, 64 + 4]


def test_requests_of_several_forms_batched_together_each_get_their_own(projected_server, unembedding):
    """A GRPO-shaped group sent at once (one padded batch): each member in its own form."""
    group = [[*IDS, 9, 10, 11], [*IDS, 9, 10, 12], [*IDS, 40, 41, 42]]
    forms = ["fp8", "", "projected"]

    async def run():
        async with TeacherClient(f"grpc://{projected_server.grpc_target}") as client:
            return await asyncio.gather(*[client.score(ids, prompt_length=3, hidden_states=True, hidden_form=form)
                                          for ids, form in zip(group, forms, strict=True)])

    answers = asyncio.run(run())
    stub = _stub(projected_server)
    for ids, form, answer in zip(group, forms, answers, strict=True):
        exact = decode_tensor(stub.Score(_request("", ids)).hidden_states)
        torch.testing.assert_close(hidden_forms.rebuilt(answer.hidden_states),
                                   hidden_forms.rebuilt(_expected(exact, form, unembedding)), atol=1e-5, rtol=0)
        assert answer.hidden_states.dtype == _expected(exact, form, unembedding).dtype


@pytest.mark.parametrize("form", ["projected", "projected_fp8", "fp4"])
def test_a_form_the_teacher_cannot_give_is_refused_naming_it(torch_server, form):
    """The session's plain tiny teacher has no projection: projected forms (and unknown ones) are a
    request error naming hidden_form, on both transports; nothing is scored."""
    with pytest.raises(grpc.RpcError) as caught:
        _stub(torch_server).Score(_request(form))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hidden_form" in caught.value.details() and form in caught.value.details()
    answer = httpx.post(torch_server.http_url + "/v1/score", timeout=30,
                        json={"token_ids": IDS, "hidden_states": True, "hidden_form": form})
    assert 400 <= answer.status_code < 500 and "hidden_form" in answer.text
    with pytest.raises(grpc.RpcError) as caught:
        list(_stub(torch_server).GetUnembedding(scoring_pb2.UnembeddingRequest(projected=True)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "projected" in caught.value.details()


def test_a_form_without_hidden_states_is_refused(projected_server):
    request = scoring_pb2.ScoreRequest(token_ids=IDS, logprobs=True, hidden_form="fp8")
    with pytest.raises(grpc.RpcError) as caught:
        _stub(projected_server).Score(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hidden_form" in caught.value.details()


def test_the_client_asks_for_the_exact_form_by_default():
    assert TeacherClient("grpc://127.0.0.1:1").build_request([1, 2, 3], hidden_states=True).hidden_form == ""


async def test_prompt_reuse_copies_hidden_rows_only_between_requests_of_one_form(tiny_model_dir, unembedding):
    """Followers of a kept prefix: one of the leader's form copies its rows (prompt reuse applies);
    others get their own form, never the leader's rows in another form."""
    from proctor.server.engines.base import EngineRequest, EngineSpec
    from proctor.server.engines.factory import create_engine

    engine = create_engine(EngineSpec(name="torch", model_path=str(tiny_model_dir), dtype="float32", inference={
        "prompt_reuse_min_tokens": 16, "hidden_projection_rank": RANK}))
    await engine.start()
    try:
        prefix = [int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))]

        def request(tail, form):
            return EngineRequest(request_id=form or "exact", token_ids=torch.tensor(prefix + tail), first_row=1,
                                 logprobs=True, topk=0, hidden_states=True, hidden_form=form)

        (leader,) = await engine.score([request([1, 2], "fp8")])
        followers = [request([3, 4], "fp8"), request([5, 6], ""), request([7, 8], "projected")]
        answers = await engine.score(followers)
        alone = [(await engine.score([request(f.token_ids[40:].tolist(), "")]))[0] for f in followers]
    finally:
        await engine.close()
    assert leader.hidden_states.dtype == torch.uint8
    assert answers[0].prompt_reused_tokens, "the fp8 follower should reuse the fp8 leader's prefix"
    for follower, answer, exact in zip(followers, answers, alone, strict=True):
        want = _expected(exact.hidden_states, follower.hidden_form, unembedding)
        assert answer.hidden_states.dtype == want.dtype and answer.hidden_states.shape == want.shape
        # Kept-prefix KV and a fresh pass round apart by ~1e-6: within one e4m3 step (2^-3 relative).
        torch.testing.assert_close(hidden_forms.rebuilt(answer.hidden_states), hidden_forms.rebuilt(want),
                                   rtol=2.0**-3, atol=1e-4)
