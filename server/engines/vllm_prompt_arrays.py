"""vLLM's prompt log-probs kept as whole arrays in the replica worker, not as Python per position.

Why: vLLM's output processor (`LogprobsProcessor._update_prompt_logprobs`, which runs in the
process that holds `AsyncLLM`: the replica worker) turns each prefill chunk's prompt log-prob
tensors `[N, K+1]` into Python lists (`tolist()`) and appends them position by position to a
`FlatLogprobs`: K+1 Python floats and ints per scored token, the worker's largest cost at
top-64, only for proctor to read them back into arrays (`prompt_logprobs.extract_rows`).
proctor never detokenizes (`detokenize=False`, so the processor has no tokenizer) and asks for
flat log-probs, so a replica worker replaces that one method (`install`): in that case each
chunk's tensors are kept as numpy arrays in `ArrayPromptLogprobs`, a `FlatLogprobs` whose flat
lists are derived from the arrays when read. Any other case (a tokenizer, dict log-probs, a
container vLLM already filled) goes to vLLM's own method unchanged. The values are vLLM's own
(float32 log-probs, the actual token first, then ranks 1..K), so answers are identical.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


@functools.cache
def _flat_class() -> type:
    from vllm.logprobs import FlatLogprobs

    class ArrayPromptLogprobs(FlatLogprobs):
        """Prompt log-probs of one request as arrays: position 0 is None, position p >= 1 holds
        the actual token and the K best (`width` = K+1 entries), in prefill chunks."""

        def __init__(self) -> None:  # not the dataclass's: its fields are views of the arrays here
            self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

        def add(self, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> None:
            self._chunks.append((token_ids, logprobs, ranks))
            self.__dict__.pop("_joined", None)

        @functools.cached_property
        def _joined(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            if not self._chunks:
                return np.zeros((0, 1), np.int64), np.zeros((0, 1), np.float32), np.zeros(0, np.int64)
            if len(self._chunks) == 1:
                return self._chunks[0]
            return tuple(np.concatenate(parts) for parts in zip(*self._chunks, strict=True))

        def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """(token ids [P, K+1], log-probs [P, K+1], actual ranks [P]) of positions 1..P."""
            return self._joined

        @property
        def _width(self) -> int:
            return int(self._joined[0].shape[1])

        @property
        def start_indices(self) -> np.ndarray:
            positions = self._joined[0].shape[0]
            return np.concatenate(([0], np.arange(positions, dtype=np.int64) * self._width))

        @property
        def end_indices(self) -> np.ndarray:
            positions = self._joined[0].shape[0]
            return np.concatenate(([0], np.arange(1, positions + 1, dtype=np.int64) * self._width))

        @property
        def token_ids(self) -> np.ndarray:
            return self._joined[0].reshape(-1)

        @property
        def logprobs(self) -> np.ndarray:
            return self._joined[1].reshape(-1)

        @property
        def ranks(self) -> np.ndarray:
            ids, _, actual = self._joined
            full = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
            full[:, 0] = actual
            return full.reshape(-1)

        @property
        def decoded_tokens(self) -> list[None]:
            return [None] * int(self._joined[0].size)

        def __len__(self) -> int:
            return 1 + int(self._joined[0].shape[0])

    return ArrayPromptLogprobs


def _as_array(tensor: Any) -> np.ndarray:
    """A numpy copy of a CPU tensor (or array): vLLM may reuse the buffers it handed over."""
    return np.array(tensor.numpy() if hasattr(tensor, "numpy") else tensor, copy=True)


def install() -> bool:
    """Replace `LogprobsProcessor._update_prompt_logprobs` in this process (idempotent); False
    when this vLLM has no such method or no flat log-probs (its own path then stays)."""
    try:
        from vllm.logprobs import FlatLogprobs
        from vllm.v1.engine.logprobs import LogprobsProcessor
    except ImportError:
        return False
    original = getattr(LogprobsProcessor, "_update_prompt_logprobs", None)
    if original is None:
        log.warning("this vLLM has no LogprobsProcessor._update_prompt_logprobs: prompt log-probs stay per position")
        return False
    if getattr(original, "proctor_arrays", False):
        return True
    arrays_class = _flat_class()

    @functools.wraps(original)
    def update_prompt_logprobs(self, prompt_logprobs_tensors) -> None:
        container = self.prompt_logprobs
        fresh = isinstance(container, FlatLogprobs) and not isinstance(container, arrays_class) and (
            len(container) == 1 and not container.token_ids)
        if self.tokenizer is not None or not (fresh or isinstance(container, arrays_class)):
            return original(self, prompt_logprobs_tensors)
        if fresh:
            container = self.prompt_logprobs = arrays_class()
        token_ids, logprobs, ranks, *_ = prompt_logprobs_tensors
        container.add(_as_array(token_ids), _as_array(logprobs), _as_array(ranks).reshape(-1))
        return None

    update_prompt_logprobs.proctor_arrays = True
    LogprobsProcessor._update_prompt_logprobs = update_prompt_logprobs
    return True
