"""An instant engine for capacity measurements: the real torch engine's answers, remembered.

The front's capacity is what it sustains when its replicas cost nothing, so the bench needs an
engine that answers at once. This one scores each distinct request with the real torch engine
the first time and replays that answer (in wire form, as a replica worker sends it) whenever
the same request comes again: answers stay exact, and a bench that repeats its sequences
measures the front alone. It runs inside replica workers (`WorkerClient(build=...)`).
"""

from __future__ import annotations

from proctor.server.engines.base import EngineRequest, EngineResult, EngineSpec, Outcome
from proctor.server.engines.factory import create_engine
from proctor.server.worker.wire import EncodedResult, encode_result

from support.engines import InjectedEngine


def _key(request: EngineRequest) -> tuple:
    score_ids = request.score_ids.tobytes() if request.score_ids is not None else b""
    return (request.token_ids.tobytes(), request.first_row, request.logprobs, request.topk,
            request.hidden_states, request.temperature, score_ids)


class RememberingEngine(InjectedEngine):
    """The torch engine for `spec`, answering a request it has seen before from memory."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(create_engine(spec))
        self.answers: dict[tuple, EncodedResult] = {}
        self.computed = 0  # requests the real engine scored

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        new = [r for r in batch if _key(r) not in self.answers]
        if new:
            for request, outcome in zip(new, await self.inner.score(new), strict=True):
                if not isinstance(outcome, EngineResult):
                    return await self.inner.score(batch)  # not rememberable: answer as the engine does
                self.answers[_key(request)] = encode_result(outcome)
            self.computed += len(new)
        return [self.answers[_key(r)] for r in batch]
