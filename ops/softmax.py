"""softmax: ``exp(x - max) / sum(exp(x - max))`` over one dim, on CPU and CUDA, with autograd (double
backward too) and torch.compile support.

The C++ ops work on the last dim of a contiguous ``[rows, cols]`` view; another ``dim`` is moved last
here and moved back, so the result is then a permuted view of a contiguous tensor. Numerically stable
for any row length; a row holding NaN, or +inf, or only -inf, gives NaN as torch.softmax does.
float32/float16/bfloat16 accumulate in float32 and return the input dtype; float64 runs in float64.
On CUDA the float32 exp is the hardware's (within 2 ulp), and a float32 result below 2^-126 (a subnormal
in torch's) is 0. Under CUDA autocast the op runs in float32, as torch.softmax does.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

import torch
from torch import nn

from opbuilder.dispatch.router import ROUTES as _ROUTES
from opbuilder.ops._checks import FLOAT_DTYPES, check_float
from opbuilder.torchop import eager, fakes, sharding
from opbuilder.torchop.inline import inline
from opbuilder.torchop.lazy import LazyOps
from opbuilder.torchop.once import refuse_forward_ad

if TYPE_CHECKING:
    from opbuilder.dispatch.record import Cost, Record, Shape

_OP = "softmax"


def _register(ns: str) -> None:
    ops = getattr(torch.ops, ns)

    # forward.nograd: the forward without an autograd formula, for calls that record no gradient
    # (opbuilder.torchop.eager): the same fake.
    @fakes.register_fake(f"{ns}::forward.nograd")
    @fakes.register_fake(f"{ns}::forward")
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @fakes.register_fake(f"{ns}::backward")
    def _(y: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
        return torch.empty(y.shape, dtype=y.dtype, device=y.device)

    def forward_setup(ctx, inputs, output) -> None:
        ctx.save_for_backward(output)

    def forward_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return ops.backward(y, grad.to(y.dtype))

    eager.register_autograd(f"{ns}::forward", forward_backward, setup_context=forward_setup)

    # Double backward. grad_x = y * (g - s), s = sum(g * y). For an upstream v:
    #   d/dg = y * (v - sum(v * y)) = backward(y, v);  d/dy = v * (g - s) - g * sum(v * y).
    def backward_setup(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    def backward_backward(ctx, v: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        y, g = ctx.saved_tensors
        v = v.to(y.dtype)
        grad_g = ops.backward(y, v) if ctx.needs_input_grad[1] else None
        grad_y = None
        if ctx.needs_input_grad[0]:
            acc = torch.float64 if y.dtype == torch.float64 else torch.float32
            y32, g32, v32 = y.to(acc), g.to(acc), v.to(acc)
            s = (g32 * y32).sum(-1, keepdim=True)
            grad_y = (v32 * (g32 - s) - g32 * (v32 * y32).sum(-1, keepdim=True)).to(y.dtype)
        return grad_y, grad_g

    eager.register_autograd(f"{ns}::backward", backward_backward, setup_context=backward_setup)

    # torch.softmax runs in float32 under CUDA autocast (float64 kept); so does this op.
    torch.library.register_autocast(f"{ns}::forward", "cuda", torch.float32)
    torch.library.register_autocast(f"{ns}::forward.nograd", "cuda", torch.float32)

    # DTensor: rows split on any dim but the last (the one softmax reads whole); the backward is linear in grad_y.
    sharding.rowwise(ops.forward.default)
    sharding.rowwise(ops.forward.nograd)
    sharding.rowwise(ops.backward.default, linear=["grad_y"])


_ops = LazyOps(_OP, _register)


def namespace():
    """The loaded ``torch.ops`` namespace (``forward``, ``backward``, and the CUDA-only ``default_plan``,
    ``forward_with_plan``, ``backward_with_plan`` used by tests and tuning); builds on first use."""
    return _ops()


def forward_op() -> torch._ops.OpOverload:
    """``forward(Tensor x) -> Tensor``: softmax over the last dim."""
    return _ops().forward.default


def backward_op() -> torch._ops.OpOverload:
    """``backward(Tensor y, Tensor grad_y) -> Tensor``: ``y * (grad_y - sum(grad_y * y, -1))``."""
    return _ops().backward.default


def _check_dim(x: torch.Tensor, dim: object) -> int:
    """``dim`` as a non-negative index into ``x``'s dims (a 0-d tensor takes -1 or 0, as in torch)."""
    if type(dim) is int:  # the common case, without operator.index's protocol lookup
        index = dim
    elif isinstance(dim, bool):
        raise TypeError(f"{_OP}: dim must be an int, got bool")
    else:
        try:
            index = operator.index(dim)
        except TypeError:
            raise TypeError(f"{_OP}: dim must be an int, got {type(dim).__name__}") from None
    ndim = x.dim() or 1
    if not -ndim <= index < ndim:
        raise ValueError(
            f"{_OP}: dim must be in [{-ndim}, {ndim - 1}] for x of shape {tuple(x.shape)}, got {index}"
        )
    return index % ndim


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.softmax(x, dim)``. x: any shape (0-d gives 1, or NaN for NaN/inf, as torch does),
    float32/float16/bfloat16/float64, CPU or CUDA; the result has x's dtype and shape."""
    ndim = x.ndim if type(x) is torch.Tensor else -1
    if type(dim) is int and (dim == -1 or dim == ndim - 1) and ndim > 0 and x.dtype in FLOAT_DTYPES \
            and _OP not in _ROUTES:
        dim = ndim - 1  # the usual call (over the last dim), checked in a few reads: it is on every call's path
    else:
        check_float(_OP, "x", x)
        dim = _check_dim(x, dim)
        if _OP in _ROUTES and (y := _ROUTES[_OP](x, dim)) is not None:  # a trace's choice, or a fallback
            return y
        ndim = x.dim()
    if eager.direct():
        forward = _ops.eager().forward
        op = forward.grad if x.requires_grad and torch.is_grad_enabled() else forward.nograd
    elif inline(x):  # a small call under torch.compile: Inductor fuses torch.softmax with its neighbours
        op = _definition  # in the layout the kernel's output has
    else:
        refuse_forward_ad(_OP, x)
        op = forward_op()
    if dim == ndim - 1 and ndim:
        return op(x)
    if ndim == 0:
        return op(x.reshape(1)).reshape(())
    return op(x.movedim(dim, -1)).movedim(-1, dim)


def _definition(x: torch.Tensor) -> torch.Tensor:
    return reference(x, -1).contiguous()


class Softmax(nn.Module):
    """Drop-in for ``torch.nn.Softmax(dim)``, with dim defaulting to the last."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


# ---- the record: what the checks, dispatch, the benchmark and the tests know of this op ----------------

def reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim)


def _cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    from opbuilder.dispatch.record import Cost

    return Cost(bytes=(5 if with_backward else 2) * math.prod(shape) * elem)


_ROWS = ("rows", "hidden")
_F32, _BF16 = torch.float32, torch.bfloat16

def record() -> Record:
    """This op's record; made at its first use (``opbuilder.jit.registry.record``): importing the op
    and calling it need none of it."""
    from opbuilder.dispatch.record import Bench, Host, Record, TensorSpec, Workloads, rows_hidden

    return Record(
        name=_OP,
        function=softmax,
        axes=_ROWS,
        inputs={"x": TensorSpec(_ROWS)},
        outputs={"y": TensorSpec(_ROWS)},
        reference=reference,
        make_inputs=rows_hidden(params=0),
        reduction=lambda shape: shape[-1],
        workloads=Workloads(
            cpu=(((4096, 4096), _F32),),
            cuda=(((4096, 4096), _F32), ((4096, 4096), _BF16), ((16384, 32768), _F32), ((16384, 32768), _BF16)),
            cuda_backward=(((32768, 4096), _BF16),),
            host=(1, 16),
        ),
        bench=Bench(
            ranks=(2,),
            shape_help="ROWSxHIDDEN (2 dims)",
            call_ours=lambda f: lambda x: f(x, dim=-1),
            cost=_cost,
            cost_model="read x, write y: 2 x rows x hidden x bytes",
            cost_model_backward="forward 2; backward reads grad_y and y, writes grad_x: 5 x rows x hidden x bytes",
        ),
        host=Host("torch.softmax", lambda x: torch.softmax(x, -1), 2.5, op="forward_op", step_limit=2.0),
    )
