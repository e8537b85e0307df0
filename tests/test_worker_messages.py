"""The front ↔ worker messages: every kind round-trips through the codec and a frame, and a
frame of an unknown kind or the wrong shape is a broken stream, not a half-read message."""

from __future__ import annotations

import pytest

from proctor.server.worker import messages
from proctor.server.worker.protocol import dumps, loads

EXAMPLES = [
    messages.Start(spec={"name": "torch"}, build=None),
    messages.Score(call=7, batch=[1, 2]),
    messages.Abort(keys=["a", "b"]),
    messages.Health(call=8),
    messages.Unembedding(call=9),
    messages.Free(offsets=[0, 4096]),
    messages.Close(),
    messages.Ready(info={"vocab": 512}, token_budget=8192),
    messages.StartFailed(message="no weights"),
    messages.Reply(call=7, value=[b"x" * (1 << 17)]),
    messages.Failed(call=7, message="EngineError: gone"),
    messages.Raised(call=7, cause="RuntimeError: bad image", out_of_memory=False),
]


def test_every_kind_has_one_struct_and_an_example():
    assert {type(example).KIND for example in EXAMPLES} == set(messages.Kind)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_a_message_round_trips_through_a_frame(message):
    assert messages.decode(loads(dumps(messages.encode(message)))) == message


@pytest.mark.parametrize("raw", [(99, 1), (int(messages.Kind.SCORE), 1), ()])
def test_an_unknown_or_misshapen_message_is_a_broken_stream(raw):
    with pytest.raises(ConnectionError, match="not one this end knows"):
        messages.decode(raw)
