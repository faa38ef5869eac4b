"""Backwards without a backward of their own (the norms'): the Python gradient path's counterpart of
``once_differentiable`` in kernels/autograd/autograd.h.

Where a backward is itself recorded (``create_graph=True``), its results come out with a node that raises a
clear error when, and only when, a second-order gradient reaches it; the node's edges are those of the
incoming gradients and the saved tensors, so that a gradient asked of the op's inputs reaches it. A
first-order gradient taken that way works; a second-order one is refused instead of silently missing a term
(the backward ops have no autograd formula: recorded as they are, they would give zeros)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def double_backward_error(op: str) -> str:
    """The error a second-order gradient through ``op`` raises (the same words as the C++ path's)."""
    return (f"{op}: double backward (a gradient of this op's gradient) is not supported by this op; take the "
            "gradient once, or use the unfused PyTorch ops for higher-order gradients")


class _Refuse(torch.autograd.Function):
    """``(op, n, *anchors, *results) -> results``, whose backward raises ``double_backward_error(op)``."""

    @staticmethod
    def forward(op: str, n: int, *tensors: Any) -> tuple[Any, ...]:
        return tuple(None if r is None else r.detach() for r in tensors[n:])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.op = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(double_backward_error(ctx.op))


def once_differentiable(op: str, backward: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
    """``backward(ctx, *grads)`` for ``register_autograd``, run without recording, its results made to refuse a
    second-order gradient where the backward is recorded (see the module docstring)."""

    def wrapped(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            results = backward(ctx, *grads)
        anchors = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor)]
        tensors = [r if isinstance(r, torch.Tensor) else None for r in results]
        return _Refuse.apply(op, len(anchors), *anchors, *tensors)

    return wrapped
