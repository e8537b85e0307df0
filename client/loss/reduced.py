"""What the reduced losses share: weights known before the forward pass, gradients formed in it.

A per-token loss takes an arbitrary ``grad_output [N]`` in its backward, so its
backward has to recompute every logit tile (6 matmuls over ``N·H·V`` for the
forward KL, against a floor of 4). But every trainer reduces the per-token loss
with weights it knows before the forward pass (verl's ``loss_agg_mode`` modes
are linear in the per-token loss given the mask; ``aggregate_weights`` gives
them). With the weights in hand, the forward pass forms ``Σ_i w_i dℓ_i/dθ``
tile by tile, right after each token chunk's normalisers, and the backward only
multiplies the stored gradients by the scalar ``grad_output``.

``transform`` is an optional elementwise function of the per-token loss applied
before weighting (verl's ``loss_max_clamp``, the ``forward_kl_topk`` floor at 0);
its derivative is taken per token chunk with autograd, on ``[rows]`` vectors,
so the reduced value and gradient are those of ``Σ_i w_i transform(ℓ_i)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

Transform = Callable[[torch.Tensor], torch.Tensor]


class Reduced(NamedTuple):
    """``total``: the scalar ``Σ_i w_i transform(ℓ_i)``, differentiable in the student inputs.

    ``per_token``: ``ℓ`` itself ``[N]`` (before ``transform``), for ``loss_min`` / ``loss_max``
    metrics. It stays differentiable so that code written against the per-token API keeps
    working, but backpropagating through it recomputes the tiles as the per-token loss does;
    backpropagate ``total`` to get the 4-matmul path.
    """

    total: torch.Tensor
    per_token: torch.Tensor


def check_weights(weights: torch.Tensor, num_tokens: int) -> None:
    """Raise unless ``weights`` is a floating ``[N]`` tensor."""
    if not isinstance(weights, torch.Tensor):
        raise ValueError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    if weights.shape != (num_tokens,):
        raise ValueError(f"weights must have shape ({num_tokens},), got {tuple(weights.shape)}")
    if not weights.is_floating_point():
        raise ValueError(f"weights must be a floating-point tensor, got dtype {weights.dtype}")


def weighted_total(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_i w_i v_i`` with zero-weight tokens selected out, as ``aggregate`` does."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return (torch.where(weights != 0, values, zero) * weights).sum()


def transformed(loss: torch.Tensor, transform: Transform | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(transform(ℓ), transform'(ℓ))`` of a chunk's per-token loss; ``(ℓ, None)`` without one.

    The derivative is autograd's (so a clamp passes the gradient exactly where
    ``torch.clamp`` does), taken on a ``[rows]`` vector: nothing vocabulary-sized.
    """
    if transform is None:
        return loss, None
    with torch.enable_grad():
        x = loss.detach().requires_grad_()
        y = transform(x)
        if y.shape != x.shape:
            raise ValueError(f"transform must be elementwise: it maps shape {tuple(x.shape)} to {tuple(y.shape)}")
        (slope,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
    return y.detach(), (torch.zeros_like(x) if slope is None else slope)


def row_scale(weights: torch.Tensor, slope: torch.Tensor | None) -> torch.Tensor:
    """The per-token factor of a chunk's gradient tile: ``w_i · transform'(ℓ_i)``."""
    return weights if slope is None else weights * slope


def scale_grads(grads: tuple[torch.Tensor | None, ...], grad_total: torch.Tensor | None) -> list:
    """The stored gradients times the scalar ``grad_output``: all the reduced backward does."""
    if grad_total is None:
        return [None] * len(grads)
    one = bool(grad_total == 1)
    return [None if g is None else (g if one else g * grad_total.to(g.dtype)) for g in grads]


def hand_over_grads(ctx, grad_total: torch.Tensor | None, grad_per_token: torch.Tensor | None) -> tuple[list, bool]:
    """The reduced backward's first step, the same for every reduced loss: the gradients stored
    by the forward pass, scaled by ``grad_total`` and handed over (no reference kept, so autograd
    adopts them as ``.grad`` without a copy); and whether the per-token output needs its own
    backward too (it is differentiable, through the recomputing per-token path)."""
    if ctx.grads is None:
        raise RuntimeError("a reduced loss can be backpropagated once: its gradients were handed over")
    stored, ctx.grads = ctx.grads, None
    grads = scale_grads(tuple(stored), grad_total)
    del stored
    per_token = grad_per_token is not None and any(ctx.needs_input_grad[:3]) and bool(grad_per_token.any())
    return grads, per_token


def add_grads(a: list, b: list) -> list:
    """Elementwise sum of two gradient lists where either entry may be None."""
    return [y if x is None else (x if y is None else x + y) for x, y in zip(a, b, strict=True)]
