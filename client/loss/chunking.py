"""The shared chunking core: tiles of logits that never add up to ``[N, V]``.

Every vocabulary-wide loss in this package walks tokens in chunks of
``chunk_tokens`` and the vocabulary in chunks of ``chunk_vocab``. A *logit
source* produces one float32 tile ``[chunk_tokens, chunk_vocab]`` of
temperature-scaled logits at a time, either from a fused ``(hidden, weight)``
pair (a small matmul per tile) or by slicing given ``[N, V]`` logits, and takes
back the gradient of the loss with respect to that tile, contracting it at once
into ``grad_hidden`` / ``grad_weight`` accumulators. Per-token softmax
normalisers are built with an online (streaming) log-sum-exp, so the extra
memory of a pass is a handful of tiles, whatever N and V are.

Everything is accumulated in float32 whatever the input dtype (bf16 logits over
a 150k vocabulary lose the loss in rounding otherwise), or in float64 when the
inputs are float64 (so that ``gradcheck`` can check the kernels themselves).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch

from proctor.proto import hidden_forms

# A tile of 2^20 float32 elements is 4 MiB; a pass holds a few of them at once (measured: at
# N=4096, V=32768 a 1024 x 1024 tile keeps the working set near 50 MiB on top of the gradients).
DEFAULT_TILE_ELEMENTS = 1 << 20
DEFAULT_CHUNK_TOKENS = 1024
MIN_CHUNK_VOCAB = 256
# Reduced losses (gradients formed in the forward pass) hold whole-vocabulary rows [rows, V] of
# both sides, in two buffers reused across token chunks. Each chunk rereads both unembeddings and
# rewrites the whole [V, H] weight gradient (its addmm has the row count as inner dimension), so
# taller rows mean less of that traffic and faster row products: on CPU (2 threads, H=1024,
# V=32768) the student-logit product runs at 120 GFLOP/s with 128 rows, 141 with 256, 159 with
# 512, against 173 for the whole [N, H] @ [H, V]. 2^23 elements (32 MiB float32, 256 rows at
# V=32768) keeps the two buffers near 3% of the dense working set at N=4096; GPUs want taller
# rows (2^25 elements: 1024 rows at V=32768, 220 at V=151936).
REDUCED_ROW_ELEMENTS = 1 << 23
REDUCED_ROW_ELEMENTS_CUDA = 1 << 25
MIN_REDUCED_ROWS = 16


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32: never accumulate below float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


@dataclass(frozen=True)
class Chunking:
    """Tile shape for one loss call."""

    chunk_tokens: int
    chunk_vocab: int

    @staticmethod
    def resolve(num_tokens: int, vocab: int, chunk_tokens: int | None, chunk_vocab: int | None) -> Chunking:
        """Pick tile sizes: given values win; otherwise fill a fixed element budget.

        The budget keeps extra memory constant in N and V; tokens come first
        because a tall tile keeps the ``grad_weight`` contraction (whose inner
        dimension is the token count) efficient.
        """
        ct = chunk_tokens if chunk_tokens is not None else min(max(num_tokens, 1), DEFAULT_CHUNK_TOKENS)
        if chunk_vocab is None:
            chunk_vocab = max(MIN_CHUNK_VOCAB, DEFAULT_TILE_ELEMENTS // max(ct, 1))
        return Chunking(ct, min(chunk_vocab, max(vocab, 1)))

    @staticmethod
    def resolve_rows(
        num_tokens: int, vocab: int, chunk_tokens: int | None, chunk_vocab: int | None, device: torch.device
    ) -> Chunking:
        """Tile shape for a reduced loss: whole-vocabulary rows unless ``chunk_vocab`` says otherwise.

        A gradient tile needs its rows' full-vocabulary normalisers; with the whole row in one
        tile they come from the same logits, so the tile is computed once (4 matmuls in all). A
        smaller ``chunk_vocab`` bounds memory further at the price of recomputing each tile.
        """
        if chunk_tokens is None:
            budget = REDUCED_ROW_ELEMENTS_CUDA if device.type == "cuda" else REDUCED_ROW_ELEMENTS
            width = vocab if chunk_vocab is None else min(chunk_vocab, vocab)
            chunk_tokens = min(DEFAULT_CHUNK_TOKENS, max(MIN_REDUCED_ROWS, budget // max(width, 1)))
            chunk_tokens = min(chunk_tokens, max(num_tokens, 1))
        return Chunking(chunk_tokens, min(vocab if chunk_vocab is None else chunk_vocab, max(vocab, 1)))

    def token_chunks(self, num_tokens: int) -> Iterator[tuple[int, int]]:
        """Yield ``(start, stop)`` of each token chunk; the last one may be short."""
        for t0 in range(0, num_tokens, self.chunk_tokens):
            yield t0, min(t0 + self.chunk_tokens, num_tokens)

    def vocab_chunks(self, vocab: int) -> Iterator[tuple[int, int]]:
        """Yield ``(start, stop)`` of each vocabulary chunk; the last one may be short."""
        for v0 in range(0, vocab, self.chunk_vocab):
            yield v0, min(v0 + self.chunk_vocab, vocab)

    def single_vocab_chunk(self, vocab: int) -> bool:
        """True when one tile spans the vocabulary, so a second pass can reuse it."""
        return self.chunk_vocab >= vocab


class RowBlock:
    """One token chunk ``[t0, t1)`` of a logit source: produces tiles, takes tile gradients."""

    src: LogitSource
    t0: int
    t1: int

    @property
    def num_rows(self) -> int:
        """Tokens in the chunk."""
        return self.t1 - self.t0

    @property
    def vocab(self) -> int:
        """Vocabulary size of the source (the width of a whole-row tile)."""
        return self.src.vocab

    def tile(self, v0: int, v1: int, out: torch.Tensor | None = None) -> torch.Tensor:  # pragma: no cover
        """Scaled logits in the compute dtype ``[rows, v1 - v0]``, row-major; the caller may overwrite them.

        A fresh tensor, or ``out`` (a contiguous buffer of that shape) filled and returned: the
        reduced losses reuse one buffer per side across token chunks, because a fresh
        whole-vocabulary block per chunk is a fresh mapping of pages to fault in and zero.
        """
        raise NotImplementedError

    def add_grad(
        self, v0: int, v1: int, grad_tile: torch.Tensor, row_scale: torch.Tensor | None = None
    ) -> None:  # pragma: no cover
        """Accumulate ``row_scale[:, None] · dL/d(scaled logits)`` of a tile into the source's gradients.

        ``row_scale`` (per-token weights) is applied to ``[rows, H]`` operands where the source
        allows, which is cheaper than scaling the ``[rows, C]`` tile.
        """
        raise NotImplementedError


class FusedSource:
    """Logits ``(hidden @ weight.T) / temperature`` computed one tile at a time.

    Gradients (when requested) go to float32 accumulators ``grad_hidden [N, H]``
    and ``grad_weight [V, H]``: those are the size of the inputs, never ``[N, V]``.
    """

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        inv_tau: float,
        grad_hidden: bool = False,
        grad_weight: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.hidden = hidden
        self.weight = weight
        self.inv_tau = inv_tau
        self.dtype = dtype
        self.num_tokens, self.vocab = hidden.shape[0], weight.shape[0]
        self.device = dev = hidden.device
        self.grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=dev) if grad_hidden else None
        self.grad_weight = torch.zeros(weight.shape, dtype=dtype, device=dev) if grad_weight else None

    def input_grads(self) -> list[torch.Tensor | None]:
        """The accumulated gradients in the inputs' dtypes, as ``[hidden, weight, logits]``."""
        gh, gw = self.grad_hidden, self.grad_weight
        hidden = None if gh is None else gh.to(self.hidden.dtype)
        return [hidden, None if gw is None else gw.to(self.weight.dtype), None]

    def weight_rows(self, v0: int, v1: int) -> torch.Tensor:
        """Rows ``weight[v0:v1]`` in the compute dtype (a view when no cast is needed)."""
        return self.weight[v0:v1].to(self.dtype)

    def rows(self, t0: int, t1: int) -> _FusedRows:
        """The token chunk ``[t0, t1)``."""
        return _FusedRows(self, t0, t1)


class _FusedRows(RowBlock):
    def __init__(self, src: FusedSource, t0: int, t1: int) -> None:
        self.src, self.t0, self.t1 = src, t0, t1
        # Packed fp8 rows (a compressed teacher, `proto.hidden_forms`) are dequantised a chunk at a time.
        h = hidden_forms.rebuilt(src.hidden[t0:t1], src.dtype)
        # Scaling the [rows, H] hidden is cheaper than scaling each [rows, C] tile.
        self.h_scaled = h * src.inv_tau if src.inv_tau != 1.0 else h

    def tile(self, v0: int, v1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        # Always [rows, H] @ [H, C]: the tile is row-major, so the row-wise tile math runs on
        # contiguous rows. (The transposed product (W @ h.T).T is a few percent faster for short
        # rows, but its column-major tile made the eager tile math 4-6x slower.)
        return torch.mm(self.h_scaled, self.src.weight_rows(v0, v1).T, out=out)

    def add_grad(
        self, v0: int, v1: int, grad_tile: torch.Tensor, row_scale: torch.Tensor | None = None
    ) -> None:
        src = self.src
        if src.grad_hidden is not None:
            # d/dh of (h / tau) @ W.T: G @ W / tau.
            out = src.grad_hidden[self.t0 : self.t1]
            if row_scale is None:
                out.addmm_(grad_tile, src.weight_rows(v0, v1), alpha=src.inv_tau)
            else:
                out.addcmul_(grad_tile @ src.weight_rows(v0, v1), row_scale[:, None], value=src.inv_tau)
        if src.grad_weight is not None:
            # d/dW: G.T @ (h / tau), which is exactly the scaled hidden we hold.
            h = self.h_scaled if row_scale is None else self.h_scaled * row_scale[:, None]
            src.grad_weight[v0:v1].addmm_(grad_tile.T, h)


class DenseSource:
    """Given logits ``[N, V]`` sliced into tiles; the gradient is ``[N, V]`` by nature."""

    def __init__(
        self, logits: torch.Tensor, inv_tau: float, grad_logits: bool = False, dtype: torch.dtype = torch.float32
    ) -> None:
        self.logits = logits
        self.inv_tau = inv_tau
        self.dtype = dtype
        self.num_tokens, self.vocab = logits.shape
        self.device = logits.device
        self.grad_logits = torch.zeros(logits.shape, dtype=dtype, device=logits.device) if grad_logits else None

    def input_grads(self) -> list[torch.Tensor | None]:
        """The accumulated gradient in the logits' dtype, as ``[hidden, weight, logits]``."""
        gl = self.grad_logits
        return [None, None, None if gl is None else gl.to(self.logits.dtype)]

    def rows(self, t0: int, t1: int) -> _DenseRows:
        """The token chunk ``[t0, t1)``."""
        return _DenseRows(self, t0, t1)


class _DenseRows(RowBlock):
    def __init__(self, src: DenseSource, t0: int, t1: int) -> None:
        self.src, self.t0, self.t1 = src, t0, t1

    def tile(self, v0: int, v1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        # Always a copy: callers transform tiles in place.
        part = self.src.logits[self.t0 : self.t1, v0:v1]
        out = part.to(self.src.dtype, copy=True) if out is None else out.copy_(part)
        if self.src.inv_tau != 1.0:
            out.mul_(self.src.inv_tau)
        return out

    def add_grad(
        self, v0: int, v1: int, grad_tile: torch.Tensor, row_scale: torch.Tensor | None = None
    ) -> None:
        g = self.src.grad_logits
        if g is not None:
            out = g[self.t0 : self.t1, v0:v1]
            if row_scale is None:
                out.add_(grad_tile, alpha=self.src.inv_tau)
            else:
                out.addcmul_(grad_tile, row_scale[:, None], value=self.src.inv_tau)


LogitSource = FusedSource | DenseSource


class OnlineLogSumExp:
    """Streaming per-row log-sum-exp over vocabulary tiles.

    Optionally also streams ``Σ_v e^{x_v} · y_v`` for a paired tile ``y``, which
    gives ``E_{softmax(x)}[y]`` at the end: that is how the forward and reverse
    KL are obtained in the same single pass that builds the normalisers.
    """

    def __init__(
        self, rows: int, device: torch.device, with_expectation: bool = False, dtype: torch.dtype = torch.float32
    ) -> None:
        self.max = torch.full((rows,), float("-inf"), dtype=dtype, device=device)
        self.sum = torch.zeros(rows, dtype=dtype, device=device)
        self.weighted = torch.zeros(rows, dtype=dtype, device=device) if with_expectation else None

    def update(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """Fold one tile ``x [rows, C]`` (and its paired values ``y``) into the running state."""
        new_max = torch.maximum(self.max, x.amax(dim=1))
        alpha = torch.exp(self.max - new_max)
        e = torch.exp(x - new_max[:, None])
        self.sum.mul_(alpha).add_(e.sum(dim=1))
        if self.weighted is not None:
            assert y is not None
            self.weighted.mul_(alpha).add_((e * y).sum(dim=1))
        self.max = new_max

    def logsumexp(self) -> torch.Tensor:
        """Final per-row ``log Σ_v e^{x_v}``."""
        return self.max + torch.log(self.sum)

    def expectation(self) -> torch.Tensor:
        """Final per-row ``Σ_v softmax(x)_v · y_v``."""
        assert self.weighted is not None
        return self.weighted / self.sum


def for_device(fn: Callable, device: torch.device, key: Hashable) -> Callable:
    """``fn`` compiled with ``torch.compile`` on CUDA, ``fn`` itself elsewhere (CPU, NPU).

    On a GPU the elementwise work of a tile (exp, log, the softmax normalisation) is what
    separates a fused loss from the matmul floor: compiled, each tile's chain of pointwise ops
    and row reductions becomes a few fused kernels instead of one memory pass per op. On CPU the
    eager ops are already a small share next to the matmuls, and NPUs run plain torch
    (torch-npu). ``key`` names the function for the cache (one compilation per key and shape).
    ``PROCTOR_LOSS_COMPILE=0`` keeps eager everywhere, ``=1`` compiles on any device.
    """
    setting = os.environ.get("PROCTOR_LOSS_COMPILE", "auto")
    use = setting == "1" or (setting == "auto" and device.type == "cuda")
    if not use or not hasattr(torch, "compile"):
        return fn
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = torch.compile(fn)
        _COMPILED[key] = compiled
    return compiled


_COMPILED: dict[Hashable, Callable] = {}


def stream_logsumexp(
    block: RowBlock, rows: int, vocab: int, chunking: Chunking, device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-row log-sum-exp of a source's token chunk, one vocabulary tile at a time."""
    acc = OnlineLogSumExp(rows, device, dtype=dtype)
    for v0, v1 in chunking.vocab_chunks(vocab):
        acc.update(block.tile(v0, v1))
    return acc.logsumexp()
