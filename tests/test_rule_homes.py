"""Each request rule has one home: the same bad value reads the same on every surface, and the
rule's message is written once in `server/`.

Behaviour: one real server on loopback (the torch engine on the tiny teacher); each bad value is
sent through gRPC `Score`, HTTP `/v1/score` (JSON) and `/v1/completions` wherever that surface
carries the field, and every answer's message must be the same text. What a teacher serves is
also asked of a real engine directly (no front: a worker or a test may hand it a request), which
must refuse by the same rule. Structure: each rule's message, read from the source, occurs in
exactly one module, and the engines' old wordings are gone.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from proctor.proto import scoring_pb2, scoring_pb2_grpc

SERVER = Path(__file__).resolve().parents[1] / "server"
TOO_BIG = 2**31  # one past int32


@pytest.fixture(scope="module")
def stub(torch_server):
    channel = grpc.insecure_channel(torch_server.grpc_target)
    yield scoring_pb2_grpc.TeacherScoringStub(channel)
    channel.close()


def _grpc(stub, **fields) -> str:
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(scoring_pb2.ScoreRequest(**fields), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


def _score(server, body: dict) -> str:
    reply = httpx.post(server.http_url + "/v1/score", json=body, timeout=60)
    assert reply.status_code == 422, reply.text
    return reply.json()["error"]["message"]


def _complete(server, **fields) -> str:
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 1, "prompt_logprobs": 2, **fields}
    reply = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]["message"]


IDS = [1, 2, 3, 4]


def _one(messages: list[str]) -> str:
    assert len(set(messages)) == 1, messages
    return messages[0]


# -- behaviour: one message per bad value, whatever the surface ------------------------------------
@pytest.mark.parametrize("temperature", [0, -1.5, 1e-40, 1e39])
def test_a_bad_temperature_reads_the_same_on_grpc_score_and_completions(torch_server, stub, temperature):
    # /v1/completions takes 0 as vLLM does (greedy, raw log-probs: `models.is_greedy`); every other
    # surface that scores at a temperature refuses it by the same rule
    completions = [] if temperature == 0 else [_complete(torch_server, temperature=temperature)]
    message = _one([_grpc(stub, token_ids=IDS, logprobs=True, temperature=temperature),
                    _score(torch_server, {"token_ids": IDS, "temperature": temperature}), *completions])
    assert message.startswith(f"temperature: is {float(temperature)}")


def test_a_temperature_of_the_wrong_json_type_reads_the_same_on_both_bodies(torch_server):
    message = _one([_score(torch_server, {"token_ids": IDS, "temperature": True}),
                    _complete(torch_server, temperature=True)])
    assert message == "temperature: must be a number, got bool"


def test_a_topk_wider_than_served_reads_the_same_on_every_surface_and_in_the_engine(torch_server, stub, tiny_model_dir):
    message = _one([_grpc(stub, token_ids=IDS, topk=65),
                    _score(torch_server, {"token_ids": IDS, "topk": 65}),
                    _complete(torch_server, prompt_logprobs=65)])
    assert message == "topk: is 65; teacher 'tiny' serves at most 64"
    # The engine, handed the request with no front, refuses it by the same rule (naming its model).
    refused = _engine_refusal(tiny_model_dir, topk=65)
    assert refused.field == "topk" and refused.message == message.replace("'tiny'", repr(tiny_model_dir.name))


def test_media_for_a_text_only_teacher_reads_the_same_and_the_engine_agrees(torch_server, stub, tiny_model_dir):
    from proctor.server.engines.base import MediaItem, MultiModalInputs

    message = _one([_grpc(stub, token_ids=IDS, logprobs=True,
                          audios=[scoring_pb2.Media(data=b"RIFF", media_type="audio/wav")]),
                    _score(torch_server, {"token_ids": IDS, "audios": [{"data": "UklGRg==", "media_type": "audio/wav"}]})])
    assert message == "audios: teacher 'tiny' (torch engine) is text-only and cannot use audios"
    refused = _engine_refusal(tiny_model_dir, media=MultiModalInputs(audios=(MediaItem(b"RIFF", "audio/wav"),)))
    assert refused.message == message.replace("'tiny'", repr(tiny_model_dir.name))


@pytest.mark.parametrize(("json_item", "grpc_item", "expected"), [
    ({"data": "", "media_type": "image/png"}, {"data": b"", "media_type": "image/png"}, "images[0].data: is empty"),
    ({"data": "aGk="}, {"data": b"hi"}, "images[0].media_type: is required (e.g. image/png)"),
])
def test_a_bad_media_item_reads_the_same_on_grpc_and_json(torch_server, stub, json_item, grpc_item, expected):
    message = _one([_grpc(stub, token_ids=IDS, logprobs=True, images=[scoring_pb2.Media(**grpc_item)]),
                    _score(torch_server, {"token_ids": IDS, "images": [json_item]})])
    assert message == expected


@pytest.mark.parametrize("text", ["[1, 2]", '"a string"', "{"])
def test_bad_processor_kwargs_read_the_same_on_grpc_and_json(torch_server, stub, text):
    message = _one([_grpc(stub, token_ids=IDS, logprobs=True, mm_processor_kwargs=text),
                    _score(torch_server, {"token_ids": IDS, "mm_processor_kwargs": text})])
    assert message.startswith("mm_processor_kwargs: ")


def test_an_id_outside_int32_reads_the_same_in_every_json_field(torch_server):
    """gRPC types its ids int32 (protobuf refuses the value client-side); every JSON field of ids
    is held to the same range with the same words."""
    wrong = [
        _score(torch_server, {"token_ids": [1, TOO_BIG]}),
        _score(torch_server, {"token_ids": IDS, "topk": 2, "score_ids": [[TOO_BIG]] * 3}),
        _score(torch_server, {"token_ids": IDS, "student_tokenizer": "s", "teacher_prompt_ids": [TOO_BIG]}),
        _score(torch_server, {"token_ids": [1, True]}),
        _complete(torch_server, prompt=[1, TOO_BIG]),
        _complete(torch_server, prompt=[[1, 2], [3, -TOO_BIG - 1]]),
    ]
    fields = [message.split(": ", 1)[0] for message in wrong]
    assert fields == ["token_ids", "score_ids", "teacher_prompt_ids", "token_ids", "prompt", "prompt[1]"]
    assert _one([message.split(": ", 1)[1] for message in wrong]) == "must be token ids: integers in the int32 range"


def _engine_refusal(model_dir: Path, **fields):
    """What a started torch engine answers, with no front before it, for a request with `fields`."""
    from proctor.server.engines.base import EngineRequest, EngineSpec, RequestRejected
    from proctor.server.engines.torch.engine import TorchEngine

    async def run():
        engine = TorchEngine(EngineSpec(name="torch", model_path=str(model_dir), max_topk=64))
        await engine.start()
        try:
            request = EngineRequest(request_id="direct", token_ids=torch.tensor(IDS), first_row=1, logprobs=True,
                                    topk=0, hidden_states=False)
            return (await engine.score([_replaced(request, fields)]))[0]
        finally:
            await engine.close()

    outcome = asyncio.run(run())
    assert isinstance(outcome, RequestRejected), outcome
    return outcome


def _replaced(request, fields):
    from dataclasses import replace

    return replace(request, **fields)


# -- structure: each rule's words written once ----------------------------------------------------
def _string_parts() -> dict[Path, list[str]]:
    """Every module of server/ -> its string constants (f-strings' literal parts included)."""
    parts = {}
    for path in SERVER.rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        tree = ast.parse(path.read_text())
        parts[path] = [node.value for node in ast.walk(tree)
                       if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return parts


RULE_WORDS = {  # a rule -> words only its message holds
    "int32 ids": "integers in the int32 range",
    "temperature's value": "it must be a finite number > 0",
    "media item type": "is required (e.g. image/png)",
    "top-k served": " serves at most ",
    "hidden states served": "does not serve hidden states",
    "score_ids served": "does not serve score_ids",
    "media served": "is text-only and cannot use ",
    "sequence length": "slots for the output token of the prefill",
}
OLD_TWINS = ["exceeds this teacher's max_topk", "configured without hidden states", "this teacher serves no score_ids",
             "has a value outside the int32 range", "must hold integer token ids", "this teacher is text-only"]


@pytest.mark.parametrize("rule", list(RULE_WORDS))
def test_each_rule_is_written_in_one_module_once(rule):
    words = RULE_WORDS[rule]
    found = [(path.relative_to(SERVER).as_posix(), text) for path, texts in _string_parts().items()
             for text in texts if words in text]
    assert len(found) == 1, found


def test_the_old_twin_wordings_are_gone():
    texts = [text for texts in _string_parts().values() for text in texts]
    assert not [words for words in OLD_TWINS if any(words in text for text in texts)]


# Fields whose refusals (`invalid("<field>", ...)` and calls naming it, such as the bounded JSON
# parse of kwargs) are written in these modules only: temperature's value in validation and its
# JSON type in the shell's models (both bodies use it), processor kwargs in `media_fields`.
FIELD_HOMES = {"temperature": {"front/validation.py", "front/http/models.py"},
               "mm_processor_kwargs": {"front/media_fields.py"}}


def test_the_int32_range_and_field_refusals_are_checked_in_their_homes_only():
    """`INT32` is compared against in `front/ids.py` only; each field of FIELD_HOMES is refused
    only in its homes (`openai_compat` no longer restates temperature)."""
    compared, named = [], {field: set() for field in FIELD_HOMES}
    for path in SERVER.rglob("*.py"):
        where = path.relative_to(SERVER).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Name) and c.id == "INT32" for c in node.comparators):
                compared.append(where)
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "invalid", "loads_bounded"):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    if isinstance(arg, ast.Constant) and arg.value in named:
                        named[arg.value].add(where)
    assert set(compared) == {"front/ids.py"}, compared
    assert named == FIELD_HOMES
