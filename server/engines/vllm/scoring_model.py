"""Proctor's scoring model for vLLM's pooling runner: the teacher's own architecture, plus a
pooler that scores every asked row on the device, in the prefill's forward pass.

Loaded only through vLLM's public extension points: `register_plugin` (the
`vllm.general_plugins` entry point, so every vLLM process runs it) registers, for every
architecture vLLM knows, a lazily imported `ProctorScoring<Arch>` (`scoring_architecture`);
the engine selects it with `hf_overrides={"architectures": [...]}`. That class is a subclass of
vLLM's own `<Arch>` (same weights, same loading, same `compute_logits`) with `is_pooling_model`
and a `ScoringPooler`.

The pooler receives the last layer's post-norm hidden states of every scheduled position (what
the model's `compute_logits` consumes) and, per request (its `ScoreAsk` in
`PoolingParams.extra_kwargs`):
- takes the positions whose rows were asked (rows `first_row..T-1`; row i from position i-1),
  so rows before `first_row` cost no lm_head work;
- runs the model's own logits path on them (`compute_logits`: lm_head and its bias, logit scale,
  final soft-cap, the vocab-parallel gather under TP), in row chunks (`row_scores`);
- computes the asked outputs at the request's temperature (`row_scores.score_rows`; the actual
  token's rank only when a request of the step asks it), and keeps
  the hidden states when asked; packs them into one uint8 tensor (`pooled_scores.pack`).
With chunked prefill a request's chunks arrive in several steps: each chunk's outputs are kept
in the request's pooling state until its last chunk, then packed once. With c prefix-cached
tokens the pooler sees positions c.. only; the answer's `first_row` says which rows exist.
No [T, V] tensor leaves the device, and none exists: at most `row_scores.LOGIT_ROWS` rows' logits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from proctor.server.engines.hidden_forms import compress_with_file
from proctor.server.engines.row_scores import RowScores, score_rows
from proctor.server.engines.vllm.adapter import (
    SCORING_TASK,
    model_registry,
    pooler_base,
    pooling_model_interface,
)
from proctor.server.engines.vllm.pooled_scores import ScoreAsk, pack

PREFIX = "ProctorScoring"
# What vLLM's memory profiling run (requests without an ask) scores: every row, a top-k and the
# hidden states, so that the profile includes the pooler's own peak (its chunk of logits).
_PROFILE_ASK = ScoreAsk(first_row=1, scores=True, topk=20, hidden=True, ranks=True)


def scoring_architecture(base_architecture: str) -> str:
    """The registered name of proctor's scoring model over `base_architecture`."""
    return f"{PREFIX}{base_architecture}"


def register_plugin() -> None:
    """vLLM's general plugin: a lazily imported scoring model for every architecture vLLM has
    (names only: nothing is imported until vLLM loads the one a replica asked for)."""
    registry = model_registry()
    for arch in sorted(registry.get_supported_archs()):
        if not arch.startswith(PREFIX):
            registry.register_model(scoring_architecture(arch), f"{__name__}:{scoring_architecture(arch)}")


def __getattr__(name: str) -> type:
    """`ProctorScoring<Arch>` classes, built on first use (vLLM imports them by name)."""
    if name.startswith(PREFIX) and len(name) > len(PREFIX):
        return scoring_model_class(name[len(PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def scoring_model_class(base_architecture: str) -> type:
    """vLLM's `base_architecture` class with `is_pooling_model` and proctor's scoring pooler."""
    base = model_registry().models[base_architecture].load_model_cls()
    pooling = pooling_model_interface()

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.pooler = ScoringPooler(self.compute_logits)

    return type(scoring_architecture(base_architecture), (base, pooling), {
        "__init__": __init__,
        "__doc__": f"vLLM's {base_architecture} scored by proctor's pooler (vllm.scoring_model).",
        "__module__": __name__,
        "is_pooling_model": True,
        "default_tok_pooling_type": "ALL",
    })


_Pooler, _PoolingParamsUpdate = pooler_base()


class ScoringPooler(_Pooler):
    """The token-wise pooler that scores rows (module docstring)."""

    def __init__(self, compute_logits: Any) -> None:
        super().__init__()
        self._compute_logits = compute_logits  # a bound method, not a submodule

    def get_supported_tasks(self) -> set[str]:
        return {SCORING_TASK}

    def get_pooling_updates(self, task: str) -> Any:
        return _PoolingParamsUpdate(requires_token_ids=True)  # the targets of the rows

    def forward(self, hidden_states: torch.Tensor, pooling_metadata: Any) -> list[torch.Tensor | None]:
        cursor = pooling_metadata.get_pooling_cursor()
        counts = cursor.num_scheduled_tokens_cpu.tolist()
        seq_lens = cursor.seq_lens_cpu.tolist()
        prompt_lens = cursor.prompt_lens_cpu.tolist()
        finished = cursor.get_finished_mask()
        # The rows' targets: vLLM's v1 runner gives the prompt ids on the CPU, its v2 runner on the device.
        token_ids = pooling_metadata.prompt_token_ids
        if token_ids is None:
            token_ids = pooling_metadata.prompt_token_ids_cpu
        chunks: list[_Chunk] = []
        start = 0
        for i, count in enumerate(counts):
            params = pooling_metadata.pooling_params[i]
            ask = ScoreAsk.from_kwargs(params.extra_kwargs) if params.extra_kwargs else _PROFILE_ASK
            chunks.append(_Chunk(i, ask, hidden_states[start : start + count], int(seq_lens[i]) - count,
                                 int(prompt_lens[i])))
            start += count
        self._score_step(chunks, token_ids)
        outputs: list[torch.Tensor | None] = []
        for i, chunk in enumerate(chunks):
            state = pooling_metadata.pooling_states[i]
            parts = getattr(state, "proctor_parts", None)
            if not parts or parts[-1]["next_position"] != chunk.first_position:
                parts = state.proctor_parts = []  # a first chunk, or a request resumed after preemption
            parts.append(chunk.part)
            if finished[i]:
                outputs.append(_packed(chunk.ask, parts, hidden_states.device))
                state.proctor_parts = None
            else:
                outputs.append(None)
        return outputs

    def _score_step(self, chunks: list[_Chunk], token_ids: torch.Tensor) -> None:
        """Every chunk's asked outputs (`_Chunk.part`), the rows of all the step's requests scored
        in one pass (`row_scores.score_rows`): a few large kernels rather than a few per request."""
        scored = [c for c in chunks if c.ask.scores and c.rows]
        if scored:
            device = scored[0].states.device
            states = torch.cat([c.states for c in scored])
            targets = torch.cat([token_ids[c.index][c.lo : c.lo + c.rows] for c in scored])
            tempered = any(c.ask.temperature != 1.0 for c in scored)
            temperatures = torch.cat([torch.full((c.rows,), c.ask.temperature) for c in scored]) if tempered else None
            width = max(c.ask.score_k for c in scored)
            wanted = torch.cat([c.score_ids(width) for c in scored]) if width else None
            scores = score_rows(
                self._logits, states, targets.to(device=device, dtype=torch.long, non_blocking=True),
                topk=max(c.ask.topk for c in scored), ranks=any(c.ask.ranks for c in scored),
                temperatures=None if temperatures is None else temperatures.to(device, non_blocking=True),
                score_ids=None if wanted is None else wanted.to(device, non_blocking=True))
            offset = 0
            for chunk in scored:
                chunk.take_scores(scores, offset)
                offset += chunk.rows
        for chunk in chunks:
            if chunk.ask.hidden:
                chunk.part["hidden"] = _hidden_part(chunk.ask, chunk.states)
            kept = chunk.ask.keep_row - 1 - chunk.first_position  # the kept row's position in the chunk
            if chunk.ask.keep_row and 0 <= kept < chunk.hidden.shape[0]:
                row = chunk.hidden[kept : kept + 1]
                chunk.part["kept"] = (self._logits(row).float().reshape(-1), row.float().reshape(-1))

    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        logits = self._compute_logits(states)
        if logits is None:  # a platform that gathers the logits to one TP rank only
            raise RuntimeError("the model's compute_logits returned no logits on this tensor-parallel rank: "
                               "proctor's scoring pooler needs a platform that all-gathers logits")
        return logits


class _Chunk:
    """One request's (the step's `index`-th) positions `first_position..` in this step, of which rows `lo..lo+rows-1` are
    asked (rows `ask.first_row..total-1`; row i from position i-1), and what was computed of them."""

    def __init__(self, index: int, ask: ScoreAsk, hidden: torch.Tensor, first_position: int, total: int) -> None:
        self.index, self.ask, self.hidden, self.first_position, self.total = index, ask, hidden, first_position, total
        self.lo = max(ask.first_row, first_position + 1)
        last = min(total - 1, first_position + hidden.shape[0])  # the last asked row in the chunk
        self.rows = max(0, last - self.lo + 1)
        self.states = hidden[self.lo - 1 - first_position : self.lo - 1 - first_position + self.rows]
        self.part: dict[str, Any] = {"first_row": self.lo, "n": self.rows, "positions": hidden.shape[0],
                                     "next_position": first_position + hidden.shape[0]}

    def score_ids(self, width: int) -> torch.Tensor:
        """This chunk's rows of the asked ids, padded with -1 to `width` columns."""
        out = torch.full((self.rows, width), -1, dtype=torch.int32)
        ids = self.ask.score_ids_tensor(self.total - self.ask.first_row)
        if ids is not None:
            out[:, : ids.shape[1]] = ids[self.lo - self.ask.first_row : self.lo - self.ask.first_row + self.rows]
        return out

    def take_scores(self, scores: RowScores, offset: int) -> None:
        rows, ask = slice(offset, offset + self.rows), self.ask
        self.part["scores"] = RowScores(
            logprobs=scores.logprobs[rows], ranks=scores.ranks[rows] if ask.ranks else None,
            topk_ids=scores.topk_ids[rows, : ask.topk] if ask.topk else None,
            topk_logprobs=scores.topk_logprobs[rows, : ask.topk] if ask.topk else None,
            score_logprobs=scores.score_logprobs[rows, : ask.score_k] if ask.score_k else None)


def _packed(ask: ScoreAsk, parts: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """One request's chunks as one answer (`pooled_scores.pack`)."""
    kept = [p for p in parts if p["n"]] or parts[:1]
    first_row, n = kept[0]["first_row"], sum(p["n"] for p in parts)
    scores = [p["scores"] for p in parts if "scores" in p]

    def joined(name: str) -> torch.Tensor | None:
        values = [getattr(s, name) for s in scores]
        return torch.cat(values) if values and values[0] is not None else None

    kept = [p["kept"] for p in parts if "kept" in p]
    hidden = [p["hidden"] for p in parts if "hidden" in p]
    if ask.scores and not scores:  # no wanted row at all (every one cached or none asked)
        empty = torch.empty(0, device=device)
        logprobs, ranks = empty, empty.to(torch.int32) if ask.ranks else None
        topk_ids = torch.empty((0, ask.topk), dtype=torch.int32, device=device) if ask.topk else None
        topk_lp = torch.empty((0, ask.topk), device=device) if ask.topk else None
        score = torch.empty((0, ask.score_k), device=device) if ask.score_k else None
    else:
        logprobs, ranks = joined("logprobs"), joined("ranks")
        topk_ids, topk_lp, score = joined("topk_ids"), joined("topk_logprobs"), joined("score_logprobs")
    return pack(first_row, n, logprobs=logprobs, ranks=ranks, topk_ids=topk_ids, topk_logprobs=topk_lp,
                score_logprobs=score, hidden=torch.cat(hidden) if hidden else None,
                kept_logits=kept[0][0] if kept else None, kept_hidden=kept[0][1] if kept else None,
                positions=sum(p["positions"] for p in parts), device=device)


def _hidden_part(ask: ScoreAsk, states: torch.Tensor) -> torch.Tensor:
    """A chunk's asked hidden states in the ask's wire form (`engines.hidden_forms`), made here on the
    device, so only that form leaves it; a copy either way (the states are the step's buffer)."""
    out = compress_with_file(states, ask.hidden_form, ask.projection)
    return out.clone() if out.data_ptr() == states.data_ptr() else out
