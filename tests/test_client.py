"""TeacherClient against a real server on loopback: values, transports, order, errors."""

from __future__ import annotations

import random

import pytest
import torch

from proctor.client import (
    NO_RETRY,
    InvalidArgument,
    Media,
    ScoreInput,
    SyncTeacherClient,
    TeacherClient,
    TeacherNotFound,
    UnembeddingMismatch,
)

from support.reference import assert_matches_reference, reference_model, reference_rows

TRANSPORTS = ("grpc", "http")


def target(server, transport: str) -> str:
    return f"grpc://{server.grpc_target}" if transport == "grpc" else server.http_url


def random_sequences(count: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, 40))] for _ in range(count)]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_scores_match_the_reference_forward(torch_server, tiny_model_dir, transport):
    ids = random_sequences(1, seed=1)[0] + [5, 6, 7]
    async with TeacherClient(target(torch_server, transport)) as client:
        scores = await client.score(ids, topk=5, hidden_states=True)
    ref = reference_rows(tiny_model_dir, ids)
    assert scores.first_row == 1 and scores.num_tokens == len(ids) and scores.teacher == "tiny"
    torch.testing.assert_close(scores.logprobs.double(), ref.logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(scores.hidden_states.double(), ref.hidden_states.double(), atol=1e-4, rtol=1e-4)
    want_ids, want_lp = ref.topk(5)
    torch.testing.assert_close(scores.topk_logprobs.double(), want_lp, atol=1e-4, rtol=0)
    assert torch.equal(scores.topk_ids.long(), want_ids)


async def test_grpc_and_http_return_identical_tensors(torch_server):
    ids = random_sequences(3, seed=2)
    async with TeacherClient(target(torch_server, "grpc")) as g, TeacherClient(target(torch_server, "http")) as h:
        for seq in ids:
            kwargs = {"prompt_length": max(1, len(seq) // 2), "topk": 8, "hidden_states": True}
            a, b = await g.score(seq, **kwargs), await h.score(seq, **kwargs)
            for name in ("logprobs", "topk_ids", "topk_logprobs", "hidden_states"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert (a.first_row, a.num_tokens, a.model) == (b.first_row, b.num_tokens, b.model)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_temperature_divides_the_teachers_logits_before_the_log_softmax(torch_server, tiny_model_dir, transport):
    ids = random_sequences(1, seed=4)[0] + [9, 10]
    async with TeacherClient(target(torch_server, transport)) as client:
        warm = await client.score(ids, topk=3, temperature=0.7)
        plain = await client.score(ids, topk=3)
    ref = reference_rows(tiny_model_dir, ids, temperature=0.7)
    torch.testing.assert_close(warm.logprobs.double(), ref.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(warm.topk_logprobs.double(), ref.topk(3)[1], atol=1e-5, rtol=0)
    assert not torch.allclose(warm.logprobs, plain.logprobs)  # it really changed the answer
    async with TeacherClient(target(torch_server, transport), retry=NO_RETRY) as client:
        with pytest.raises(InvalidArgument) as err:
            await client.score(ids, temperature=0.0)
    assert err.value.field == "temperature"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_prompt_length_returns_only_response_rows(torch_server, tiny_model_dir, transport):
    ids = list(range(10, 30))
    async with TeacherClient(target(torch_server, transport)) as client:
        scores = await client.score(ids, prompt_length=12, topk=3)
    assert scores.first_row == 12 and scores.logprobs.shape == (8,) and scores.topk_ids.shape == (8, 3)
    assert_matches_reference(scores.logprobs, tiny_model_dir, ids, first_row=12, atol=1e-4)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_score_many_256_at_concurrency_32_returns_every_result_in_order(torch_server, tiny_model_dir, transport):
    sequences = random_sequences(256, seed=3)
    async with TeacherClient(target(torch_server, transport), max_concurrency=32) as client:
        results = await client.score_many(sequences)
    assert len(results) == 256
    for seq, scores in zip(sequences, results, strict=True):
        assert scores.num_tokens == len(seq)
        assert_matches_reference(scores.logprobs, tiny_model_dir, seq, atol=1e-4)
    assert len({s.request_id for s in results}) == 256


async def test_score_many_takes_per_sequence_inputs(torch_server):
    async with TeacherClient(target(torch_server, "grpc")) as client:
        results = await client.score_many(
            [ScoreInput([1, 2, 3, 4], prompt_length=2), ScoreInput([5, 6, 7], teacher_key="tiny")], topk=2
        )
    assert [r.first_row for r in results] == [2, 1]
    assert all(r.topk_ids.shape[1] == 2 for r in results)


async def test_stream_hidden_states_reassembles_many_chunks(tiny_model_dir, torch_server):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec

    from support.servers import start_server

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir))
    # 64 floats per row: 1 KiB chunks hold 4 rows, so 60 rows come in 15 chunks.
    server = start_server(single_teacher_router(spec, name="tiny"), stream_chunk_bytes=1024)
    try:
        ids = random_sequences(1, seed=4)[0][:1] + list(range(60))
        async with TeacherClient(f"grpc://{server.grpc_target}") as streamed, TeacherClient(server.http_url) as unary:
            a = await streamed.stream_hidden_states(ids, topk=4)
            b = await unary.score(ids, topk=4, hidden_states=True)
        assert a.hidden_states.shape == (60, 64)
        assert torch.equal(a.hidden_states, b.hidden_states)
        assert torch.equal(a.topk_ids, b.topk_ids)
    finally:
        server.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_unembedding_is_the_teachers_lm_head_and_is_cached(torch_server, tiny_model_dir, transport):
    async with TeacherClient(target(torch_server, transport)) as client:
        weight = await client.unembedding("tiny")
        again = await client.unembedding()
    assert again is weight
    assert torch.equal(weight, reference_model(tiny_model_dir).get_output_embeddings().weight)


async def test_unembedding_from_other_weights_is_refused(torch_server):
    async with TeacherClient(target(torch_server, "grpc")) as client:
        teachers = await client.teachers()
        info = teachers["tiny"]
        # The catalogue says the teacher has other weights than the server streams.
        client._teachers = {"tiny": type(info)(**{**info.__dict__, "fingerprint": "0000000000000000"})}
        with pytest.raises(UnembeddingMismatch, match="fingerprint"):
            await client.unembedding("tiny")


async def test_http_stream_reassembles_like_grpc(torch_server):
    ids = list(range(3, 200))
    async with TeacherClient(target(torch_server, "grpc")) as via_grpc, \
            TeacherClient(target(torch_server, "http")) as via_http:
        a = await via_grpc.stream_hidden_states(ids, topk=3)
        b = await via_http.stream_hidden_states(ids, topk=3)
    assert torch.equal(a.hidden_states, b.hidden_states) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_teachers_lists_the_tiny_teacher(torch_server, transport):
    async with TeacherClient(target(torch_server, transport)) as client:
        teachers = await client.teachers()
    info = teachers["tiny"]
    assert (info.vocab_size, info.hidden_size, info.engine) == (512, 64, "torch")
    assert "hidden_states" in info.outputs and len(info.fingerprint) == 16


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bad_token_is_an_invalid_argument_naming_the_field_and_not_retried(torch_server, transport):
    async with TeacherClient(target(torch_server, transport)) as client:
        with pytest.raises(InvalidArgument) as caught:
            await client.score([1, 2, 99999])
        assert caught.value.field == "token_ids" and "99999" in caught.value.message
        assert client.retries == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_unknown_teacher_key_raises_not_found(torch_server, transport):
    async with TeacherClient(target(torch_server, transport)) as client:
        with pytest.raises(TeacherNotFound, match="no teacher for key 'nope'"):
            await client.score([1, 2, 3], teacher_key="nope")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_media_reach_the_server_as_bytes_with_their_type(torch_server, transport):
    async with TeacherClient(target(torch_server, transport), retry=NO_RETRY) as client:
        # The torch teacher is text-only, so the server names the media field it refuses.
        with pytest.raises(InvalidArgument) as caught:
            await client.score([1, 2, 3], images=[Media(b"\x89PNG", "image/png")], audios=[(b"RIFF", "audio/wav")])
    assert caught.value.field in ("images", "audios") and "text-only" in caught.value.message


async def test_malformed_media_is_refused_before_sending(torch_server):
    async with TeacherClient(target(torch_server, "grpc")) as client:
        with pytest.raises(InvalidArgument, match=r"images\[0\]"):
            await client.score([1, 2, 3], images=["not bytes"])


def test_blocking_facade_scores_like_the_async_client(torch_server, tiny_model_dir):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with SyncTeacherClient(target(torch_server, "grpc")) as client:
        scores = client.score(ids, prompt_length=4)
        many = client.score_many([ids, ids[:5]])
        assert "tiny" in client.teachers()
    assert_matches_reference(scores.logprobs, tiny_model_dir, ids, first_row=4, atol=1e-4)
    assert [m.num_tokens for m in many] == [8, 5]
