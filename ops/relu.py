"""relu: ``y = max(x, 0)`` (NaN kept), on CPU and CUDA, with autograd and torch.compile support."""

from __future__ import annotations

import torch
from torch import nn

from opbuilder.ops._checks import check_float
from opbuilder.lazy import LazyOps


def _register(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::relu")
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(output)

    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        # One fused pass (grad where out > 0, else 0), as torch.relu's own backward.
        return torch.ops.aten.threshold_backward(grad, out, 0)

    torch.library.register_autograd(f"{ns}::relu", backward, setup_context=setup_context)


_ops = LazyOps("relu", _register)


def relu_op() -> torch._ops.OpOverload:
    """The loaded Torch op (``torch.ops.opb_relu_<key>.relu.default``); builds on first use."""
    return _ops().relu.default


def relu(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0)`` elementwise. x: any shape, float32/float16/bfloat16, CPU or CUDA."""
    check_float("relu", "x", x)
    return relu_op()(x)


class ReLU(nn.Module):
    """Drop-in for ``torch.nn.ReLU()`` (not in-place)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu(x)
