"""Matrix-product work of a loss call, counted at the dispatcher: a figure machine load cannot move.

Wall times on a shared machine wander; the number of multiply-adds a loss issues
does not. ``MatmulWork`` is a ``TorchDispatchMode`` that adds up ``2·m·k·n`` of
every matrix product that runs while it is active, forward and backward. It
counts the in-place ``addmm_`` the chunked losses accumulate gradients with
(``torch.utils.flop_counter`` does not).
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# (packet name, index of the first matrix operand)
_PRODUCTS = {"mm": 0, "bmm": 0, "addmm": 1, "addmm_": 1, "baddbmm": 1, "baddbmm_": 1}
_VECTOR_PRODUCTS = {"mv": 0, "addmv": 1, "addmv_": 1}


class MatmulWork(TorchDispatchMode):
    """Counts ``flops`` (2 per multiply-add) of ``mm``/``addmm``/``addmm_``/``bmm``/``baddbmm``/``mv``."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in _PRODUCTS:
            i = _PRODUCTS[name]
            a, b = args[i], args[i + 1]
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
            self.calls += 1
        elif name in _VECTOR_PRODUCTS:
            a = args[_VECTOR_PRODUCTS[name]]
            self.flops += 2 * a.shape[0] * a.shape[1]
            self.calls += 1
        return func(*args, **(kwargs or {}))


def matmul_flops(fn) -> int:
    """Run ``fn()`` (forward and backward inside it) and return its matrix-product flops."""
    with MatmulWork() as work:
        fn()
    return work.flops


__all__ = ["MatmulWork", "matmul_flops"]
