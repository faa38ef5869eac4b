"""relu: ``y = max(x, 0)`` (NaN kept), on CPU and CUDA, with autograd and torch.compile support.

Where a gradient is needed, the forward runs ``relu_mask``, which also writes one bit per element (0
where y <= 0: all the backward needs), and the backward reads those bits instead of y: a fp32 step moves
4 x 4 + 1/8 bytes an element instead of 5 x 4 (torch.compile saves a byte an element)."""

from __future__ import annotations

import math
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


def mask_words(numel: int, dtype: torch.dtype) -> int:
    """The int32 words of relu_mask's mask for ``numel`` elements of ``dtype`` (kernels/relu/relu_mask.h)."""
    per = 16 // dtype.itemsize
    return -(-numel // (32 * per)) * per


def _register(ns: str) -> None:
    # The .nograd overloads are the forwards without an autograd formula, for calls that record no gradient
    # (opbuilder.torchop.eager; relu_mask.nograd is the forward of relu_mask's Function): the same fakes.
    @fakes.register_fake(f"{ns}::relu.nograd")
    @fakes.register_fake(f"{ns}::relu")
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @fakes.register_fake(f"{ns}::relu_mask.nograd")
    @fakes.register_fake(f"{ns}::relu_mask")
    def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.empty((mask_words(x.numel(), x.dtype),), dtype=torch.int32, device=x.device)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device), mask

    @fakes.register_fake(f"{ns}::relu_mask_backward")
    def _(grad_y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.empty(grad_y.shape, dtype=grad_y.dtype, device=grad_y.device)

    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(output)

    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        # One fused pass (grad where out > 0, else 0), as torch.relu's own backward.
        return torch.ops.aten.threshold_backward(grad, out, 0)

    eager.register_autograd(f"{ns}::relu", backward, setup_context=setup_context)

    mask_backward = getattr(torch.ops, ns).relu_mask_backward.default

    def setup_mask(ctx, inputs, output) -> None:
        _, mask = output
        ctx.mark_non_differentiable(mask)
        ctx.save_for_backward(mask)

    def backward_mask(ctx, grad_y: torch.Tensor, _grad_mask: torch.Tensor | None) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return mask_backward(grad_y, mask)

    eager.register_autograd(f"{ns}::relu_mask", backward_mask, setup_context=setup_mask)

    # relu's eager call with a gradient, until its C++ path is there: relu_mask's Function, y alone.
    eager.register_python_grad(f"{ns}::relu", lambda x: _ops.eager().relu_mask.apply(x)[0])

    # The backward is linear in grad_y with the same mask: its own gradient is itself.
    def setup_mask_backward(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[1])

    def backward_mask_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mask,) = ctx.saved_tensors
        return mask_backward(grad, mask), None

    eager.register_autograd(f"{ns}::relu_mask_backward", backward_mask_backward,
                                    setup_context=setup_mask_backward)

    # DTensor: relu keeps any layout. relu_mask's mask packs the sign bits of each rank's own piece of x (in
    # words padded per piece): not a piece of the whole x's mask, and silent on how x was split, so no
    # redistribution of a mask (a gather, or a chunk of a whole one) gives the bits another layout needs. It is
    # made beside a y split on dim 0 (on a 1-D mesh; an x split on another dim is moved to dim 0 first) or a
    # whole y, and its backward takes the mask as it comes, with grad_y brought to that mask's layout.
    def mask_rule(x):
        from torch.distributed.tensor import Replicate, Shard  # called only once DTensor is imported

        split = [([Shard(0), Shard(0)], [Shard(0)])] if x.ndim and len(x.placements) == 1 else []
        return [([Replicate(), Replicate()], [Replicate()])] + split

    def mask_backward_rule(grad_y, mask):
        from torch.distributed.tensor import Partial, Replicate, Shard

        # (grad_x, [grad_y, mask]); linear in grad_y, so a Partial grad_y may pass with a whole mask.
        if tuple(mask.placements) == (Shard(0),):
            return [([Shard(0)], [Shard(0), Shard(0)])]
        if all(isinstance(p, Replicate) for p in mask.placements):
            return [([Replicate()], [Replicate(), Replicate()]), ([Partial()], [Partial(), Replicate()])]
        raise ValueError(f"relu_mask_backward: a mask placed {tuple(mask.placements)} is not one relu_mask makes "
                         "(Replicate, or Shard(0) on a 1-D mesh), and cannot be redistributed")

    lib = getattr(torch.ops, ns)
    sharding.elementwise(lib.relu.default)
    sharding.elementwise(lib.relu.nograd)
    sharding.custom(lib.relu_mask.default, mask_rule)
    sharding.custom(lib.relu_mask.nograd, mask_rule)
    sharding.custom(lib.relu_mask_backward.default, mask_backward_rule)


_ops = LazyOps("relu", _register)


def relu_op() -> torch._ops.OpOverload:
    """The loaded Torch op (``torch.ops.opb_relu_<key>.relu.default``); builds on first use."""
    return _ops().relu.default


def relu_mask_op() -> torch._ops.OpOverload:
    """``relu_mask(x) -> (y, mask)``: relu and the sign bits its backward reads."""
    return _ops().relu_mask.default


def relu_mask_backward_op() -> torch._ops.OpOverload:
    """``relu_mask_backward(grad_y, mask) -> grad_x``."""
    return _ops().relu_mask_backward.default


def relu(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0)`` elementwise. x: any shape, float32/float16/bfloat16, CPU or CUDA."""
    if not (type(x) is torch.Tensor and x.dtype in FLOAT_DTYPES and "relu" not in _ROUTES):
        # Anything but the usual call (checked in a few reads above: it is on every call's path).
        check_float("relu", "x", x)
        if "relu" in _ROUTES and (y := _ROUTES["relu"](x)) is not None:  # a trace's choice, or a fallback
            return y
    if eager.direct() and type(x) is torch.Tensor:  # a subclass (a DTensor, ...) takes the registered op
        ops = _ops.eager()
        if x.requires_grad and torch.is_grad_enabled():
            return ops.relu.grad(x)
        return ops.relu.nograd(x)
    if inline(x):  # a small call under torch.compile: Inductor fuses torch.relu with its neighbours
        return reference(x).contiguous()  # as the kernel's output
    refuse_forward_ad("relu", x)
    # A DTensor takes relu's own backward (from y): the mask could only follow an x split on dim 0. So does a
    # call torch.jit.trace records: one op whatever the grad mode (its check of the trace runs under no_grad).
    if x.requires_grad and torch.is_grad_enabled() and not sharding.is_dtensor(x) and not eager.jit_tracing():
        return relu_mask_op()(x)[0]
    return relu_op()(x)


class ReLU(nn.Module):
    """Drop-in for ``torch.nn.ReLU()`` (not in-place)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu(x)


# ---- the record: what the checks, dispatch, the benchmark and the tests know of this op ----------------

def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def _cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    from opbuilder.dispatch.record import Cost

    n = math.prod(shape)
    return Cost(bytes=4 * n * elem + (n + 3) // 4 if with_backward else 2 * n * elem)


_ROWS = ("rows", "hidden")

def record() -> Record:
    """This op's record; made at its first use (``opbuilder.jit.registry.record``): importing the op
    and calling it need none of it."""
    from opbuilder.dispatch.record import Bench, Host, Record, TensorSpec, Workloads, rows_hidden

    return Record(
        name="relu",
        function=relu,
        axes=_ROWS,
        inputs={"x": TensorSpec(_ROWS)},
        outputs={"y": TensorSpec(_ROWS)},
        reference=reference,
        make_inputs=rows_hidden(params=0),
        workloads=Workloads(cpu=(((4096, 4096), torch.float32),), cuda=(((32768, 8192), torch.float32),),
                            cuda_backward=(((32768, 8192), torch.float32),), host=(16,)),
        bench=Bench(
            ranks=(1, 2, 3, 4),
            shape_help="any shape, e.g. ROWSxCOLS",
            call_ours=lambda f: f,
            cost=_cost,
            cost_model="read x, write y: 2 x numel x bytes",
            cost_model_backward=(
                "forward reads x, writes y and 1 bit per element (the sign, all the backward needs); backward reads "
                "grad_y and the bits, writes grad_x: 4 x numel x bytes + numel / 4"
            ),
        ),
        host=Host("torch.relu", torch.relu, 2.5, op="relu_op", grad_op="relu_mask_op", grad_first=True, step_limit=2.0),
    )
