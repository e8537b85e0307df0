"""Aligned requests through real servers: a student with another tokenizer, both transports.

One server on loopback (the torch engine on the tiny teacher) knows two student tokenizers:
`student` (the tiny student's: other merges, another vocabulary) and `same` (the teacher's own).
"""

from __future__ import annotations

import grpc
import httpx
import pytest
import torch
from transformers import AutoTokenizer

from proctor.client import AlignedScores, InvalidArgument, TeacherClient
from proctor.proto import scoring_pb2, scoring_pb2_grpc

from support.reference import reference_rows
from support.servers import request_count, start_server

TRANSPORTS = ("grpc", "http")
PROMPT = "User: what is 12 times 7? Assistant:"
ASCII_RESPONSE = " 12 times 7 is 84.  The quick brown fox\t\tjumps over 3141592 lazy dogs.\n\nDone"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny_student_dir):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec

    spec = EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=64)
    students = {"student": str(tiny_student_dir), "same": str(tiny_model_dir)}
    running = start_server(single_teacher_router(spec, name="tiny"), student_tokenizers=students)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def toks(tiny_model_dir, tiny_student_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_student_dir)


def target(server, transport: str) -> str:
    return f"grpc://{server.grpc_target}" if transport == "grpc" else server.http_url


def _ends(tokenizer, ids) -> list[int]:
    """Byte offsets where each token ends, from the tokenizer's own decode (ASCII text)."""
    ends, total = [], 0
    for token in ids:
        total += len(tokenizer.decode([token]).encode())
        ends.append(total)
    return ends


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_aligned_scores_equal_a_transformers_forward_of_the_teacher_on_its_own_tokenization(
        server, toks, tiny_model_dir, transport):
    teacher, student = toks
    s_prompt, s_response = student(PROMPT)["input_ids"], student(ASCII_RESPONSE)["input_ids"]
    t_prompt, t_response = teacher(PROMPT)["input_ids"], teacher(ASCII_RESPONSE)["input_ids"]
    async with TeacherClient(target(server, transport)) as client:
        got = await client.score(s_prompt + s_response, prompt_length=len(s_prompt), topk=8,
                                 student_tokenizer="student", teacher_prompt_ids=t_prompt)
    assert isinstance(got, AlignedScores)
    assert (got.first_row, got.num_tokens, got.num_rows) == (len(s_prompt), len(s_prompt) + len(s_response),
                                                            len(s_response))
    assert got.teacher_ids.tolist() == t_prompt + t_response  # the teacher's tokenizer's own ids
    ref = reference_rows(tiny_model_dir, t_prompt + t_response, len(t_prompt))
    torch.testing.assert_close(got.teacher_scores.logprobs.double(), ref.logprobs, atol=1e-5, rtol=0)
    # Chunks from the two tokenizers' own decodes: the shared end offsets.
    s_ends, t_ends = _ends(student, s_response), _ends(teacher, t_response)
    shared = sorted(set(s_ends) & set(t_ends))
    student_chunk = [next(c for c, end in enumerate(shared) if end >= e) for e in s_ends]
    teacher_chunk = [next(c for c, end in enumerate(shared) if end >= e) for e in t_ends]
    assert got.chunk_ids.tolist() == student_chunk
    sums = [sum(float(ref.logprobs[j]) for j, c in enumerate(teacher_chunk) if c == chunk) for chunk in student_chunk]
    torch.testing.assert_close(got.chunk_logprobs.double(), torch.tensor(sums, dtype=torch.float64), atol=1e-5, rtol=0)
    # At 1:1 chunks the teacher's top-8 in student ids (by the token's own string), -1 without one.
    ref_ids, ref_lp = ref.topk(8)
    student_vocab = student.get_vocab()
    one_to_one = 0
    for row, chunk in enumerate(student_chunk):
        if student_chunk.count(chunk) == 1 and teacher_chunk.count(chunk) == 1:
            one_to_one += 1
            j = teacher_chunk.index(chunk)
            want = [student_vocab.get(teacher.convert_ids_to_tokens(int(t)), -1) for t in ref_ids[j]]
            assert got.topk_ids[row].tolist() == want
            mapped = torch.tensor(want) >= 0
            torch.testing.assert_close(got.topk_logprobs[row][mapped].double(), ref_lp[j][mapped], atol=1e-5, rtol=0)
        else:
            assert (got.topk_ids[row] == -1).all()
    assert 0 < one_to_one < len(s_response)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_identical_tokenizers_answer_exactly_what_a_plain_request_answers(server, toks, transport):
    teacher, _ = toks
    g = torch.Generator().manual_seed(3)
    prompt = teacher(PROMPT)["input_ids"]
    async with TeacherClient(target(server, transport)) as client:
        for length in (1, 7, 40):  # any ids, canonical or not
            ids = prompt + torch.randint(3, 512, (length,), generator=g).tolist()
            plain = await client.score(ids, prompt_length=len(prompt), topk=5)
            got = await client.score(ids, prompt_length=len(prompt), topk=5, student_tokenizer="same",
                                     teacher_prompt_ids=prompt)
            assert torch.equal(got.chunk_logprobs, plain.logprobs)
            assert torch.equal(got.topk_ids, plain.topk_ids) and torch.equal(got.topk_logprobs, plain.topk_logprobs)
            assert torch.equal(got.chunk_ids, torch.arange(length, dtype=torch.int32))
            assert torch.equal(got.unmapped_mass, torch.zeros(length))
            assert torch.equal(got.teacher_scores.logprobs, plain.logprobs)
            assert got.teacher_ids.tolist() == ids


async def test_messages_are_rendered_by_the_teachers_chat_template(server, toks, tiny_model_dir):
    teacher, student = toks
    s_prompt, s_response = student("User: hi\nAssistant:")["input_ids"], student(" hello 東京")["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = teacher.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    t_prompt = teacher(rendered, add_special_tokens=False)["input_ids"]
    async with TeacherClient(server.http_url) as client:
        got = await client.score(s_prompt + s_response, prompt_length=len(s_prompt), student_tokenizer="student",
                                 messages=messages)
        by_ids = await client.score(s_prompt + s_response, prompt_length=len(s_prompt),
                                    student_tokenizer="student", teacher_prompt_ids=t_prompt)
    assert got.teacher_ids.tolist()[: len(t_prompt)] == t_prompt
    assert torch.equal(got.chunk_logprobs, by_ids.chunk_logprobs) and torch.equal(got.chunks, by_ids.chunks)
    assert got.topk_ids is None  # no top-k asked


async def test_a_long_response_is_aligned_off_the_loop_and_sums_to_the_teachers_total(server, toks):
    _, student = toks
    text = " ".join(f"{i} fox über 東京" for i in range(200))
    ids = student(PROMPT)["input_ids"] + student(text)["input_ids"]
    assert len(ids) > 1024  # past ALIGN_INLINE_TOKENS: a worker thread does the work
    async with TeacherClient(f"grpc://{server.grpc_target}") as client:
        got = await client.score(ids, prompt_length=5, student_tokenizer="student", teacher_prompt_ids=[1, 2, 3],
                                 topk=3)
    starts = (got.student_spans[:, 0] - got.first_row).long()
    total = got.chunk_logprobs.double()[starts].sum()
    assert abs(float(total) - float(got.teacher_scores.logprobs.double().sum())) < 1e-3
    assert got.byte_spans[0, 0] == 0 and (got.byte_spans[1:, 0] == got.byte_spans[:-1, 1]).all()


def test_json_answers_carry_the_aligned_fields_over_all_rows(server, toks):
    teacher, student = toks
    s_prompt, s_response = student(PROMPT)["input_ids"], student(" 12 times 7")["input_ids"]
    body = {"token_ids": s_prompt + s_response, "prompt_length": len(s_prompt), "topk": 2,
            "student_tokenizer": "student", "teacher_prompt_ids": teacher(PROMPT)["input_ids"]}
    answer = httpx.post(server.http_url + "/v1/score", json=body, timeout=30).json()
    aligned, total = answer["aligned"], len(body["token_ids"])
    assert (answer["num_tokens"], answer["first_row"]) == (total, len(s_prompt))
    for name in ("chunk_ids", "chunk_logprobs", "topk_ids", "topk_logprobs", "unmapped_mass"):
        assert len(aligned[name]) == total and aligned[name][: len(s_prompt)] == [None] * len(s_prompt), name
    assert aligned["teacher"]["num_tokens"] == len(aligned["teacher_ids"])
    protobuf = httpx.post(server.http_url + "/v1/score", json=body, timeout=30,
                          headers={"accept": "application/x-protobuf"})
    wire = scoring_pb2.ScoreResponse.FromString(protobuf.content).aligned
    from proctor.proto import decode_tensor

    # JSON's scores read back as the same float32 (`front.float_text`: 9 significant digits)
    assert torch.equal(decode_tensor(wire.chunk_logprobs),
                       torch.tensor(aligned["chunk_logprobs"][len(s_prompt):], dtype=torch.float32))
    assert decode_tensor(wire.chunks).tolist() == aligned["chunks"]


async def test_list_teachers_names_the_student_tokenizers_and_each_pairs_map(server, tiny_student_dir):
    from proctor.server.engines.fingerprint import model_fingerprint

    for transport in TRANSPORTS:
        async with TeacherClient(target(server, transport)) as client:
            students = await client.student_tokenizers()
            info = (await client.teachers())["tiny"]
        assert students["student"].vocab_size == 400 and students["same"].vocab_size == 512
        assert students["student"].fingerprint == model_fingerprint(tiny_student_dir)
        matches = dict(info.aligned_vocabularies)
        assert matches["same"] == 512 and 200 < matches["student"] < 400 and info.chat_template


BAD = [  # (case, fields over a good aligned request, field named)
    ("unknown student tokenizer", {"student_tokenizer": "nope"}, "student_tokenizer"),
    ("id outside the student's vocabulary", {"token_ids": [5, 6, 450, 7]}, "token_ids"),
    ("messages the template cannot render", {"teacher_prompt_ids": None, "messages": [{"role": "wizard",
                                                                                       "content": "x"}]}, "messages"),
    ("both prompts", {"messages": [{"role": "user", "content": "x"}]}, "teacher_prompt_ids"),
    ("no teacher prompt", {"teacher_prompt_ids": None}, "teacher_prompt_ids"),
    ("teacher prompt id out of range", {"teacher_prompt_ids": [1, 600]}, "teacher_prompt_ids"),
    ("hidden states", {"hidden_states": True}, "hidden_states"),
]
GOOD = {"token_ids": [5, 6, 7, 8, 9], "prompt_length": 2, "student_tokenizer": "student",
        "teacher_prompt_ids": [1, 2, 3], "logprobs": True}


def _body(fields: dict) -> dict:
    return {k: v for k, v in {**GOOD, **fields}.items() if v is not None}


def _message(body: dict) -> scoring_pb2.ScoreRequest:
    request = scoring_pb2.ScoreRequest(
        token_ids=body["token_ids"], prompt_length=body["prompt_length"], student_tokenizer=body["student_tokenizer"],
        teacher_prompt_ids=body.get("teacher_prompt_ids", []), hidden_states=body.get("hidden_states", False),
        messages=[scoring_pb2.AlignedMessage(**m) for m in body.get("messages", [])], logprobs=True)
    return request


def _still_serving(server) -> None:
    channel = grpc.insecure_channel(server.grpc_target)
    answer = scoring_pb2_grpc.TeacherScoringStub(channel).Score(_message(GOOD))
    channel.close()
    assert answer.HasField("aligned")
    assert httpx.post(server.http_url + "/v1/score", json=GOOD, timeout=30).status_code == 200


@pytest.mark.parametrize(("case", "fields", "field"), BAD, ids=[c[0] for c in BAD])
def test_grpc_bad_aligned_input_names_the_field(server, case, fields, field):
    channel = grpc.insecure_channel(server.grpc_target)
    with pytest.raises(grpc.RpcError) as info:
        scoring_pb2_grpc.TeacherScoringStub(channel).Score(_message(_body(fields)))
    channel.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: ")
    _still_serving(server)


@pytest.mark.parametrize(("case", "fields", "field"), BAD, ids=[c[0] for c in BAD])
def test_http_bad_aligned_input_names_the_field(server, case, fields, field):
    reply = httpx.post(server.http_url + "/v1/score", json=_body(fields), timeout=30)
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert error["field"] == field and error["message"].startswith(f"{field}: ")
    _still_serving(server)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_client_raises_invalid_argument_naming_the_field(server, transport):
    async with TeacherClient(target(server, transport)) as client:
        with pytest.raises(InvalidArgument) as info:
            await client.score([5, 6, 7], prompt_length=1, student_tokenizer="nope", teacher_prompt_ids=[1])
    assert info.value.field == "student_tokenizer"
    assert request_count(server, "invalid_argument") > 0


def test_score_stream_answers_an_aligned_request_in_one_chunk(server):
    channel = grpc.insecure_channel(server.grpc_target)
    chunks = list(scoring_pb2_grpc.TeacherScoringStub(channel).ScoreStream(_message(GOOD)))
    unary = scoring_pb2_grpc.TeacherScoringStub(channel).Score(_message(GOOD))
    channel.close()
    assert len(chunks) == 1 and chunks[0].last
    assert chunks[0].response.aligned.chunk_logprobs == unary.aligned.chunk_logprobs
    assert chunks[0].response.aligned.teacher.logprobs == unary.aligned.teacher.logprobs


def test_a_malformed_messages_list_is_refused_in_json(server):
    reply = httpx.post(server.http_url + "/v1/score", json=_body({"teacher_prompt_ids": None,
                                                                   "messages": [{"role": "user"}]}), timeout=30)
    assert reply.status_code == 422 and reply.json()["error"]["field"] == "messages[0]"


def test_a_student_tokenizer_that_cannot_be_loaded_stops_serve(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "serve", "--grpc-port", "0", "--http-port", "0",
                           "--no-verbose", "--student-tokenizer", f"broken={tmp_path / 'missing'}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "cannot serve: student tokenizer 'broken'" in done.stderr and "not a directory" in done.stderr


def test_a_configs_student_tokenizers_become_server_options_and_missing_ones_are_named(tmp_path, tiny_model_dir,
                                                                                       tiny_student_dir):
    from proctor.server.config import ConfigError, load_server_config

    from support.configs import cpu_config, torch_teacher, write_config

    server = {"student_tokenizers": {"student": str(tiny_student_dir)}}
    doc = cpu_config({"t": torch_teacher(tiny_model_dir)}, devices=1, server=server)
    _, options = load_server_config(write_config(tmp_path, doc))
    assert options.student_tokenizers == {"student": str(tiny_student_dir)}
    doc = cpu_config({"t": torch_teacher(tiny_model_dir)}, devices=1,
                     server={"student_tokenizers": {"gone": str(tmp_path / "gone")}})
    with pytest.raises(ConfigError) as err:
        load_server_config(write_config(tmp_path, doc))
    assert err.value.problems[0].startswith("server.student_tokenizers.gone: ")
