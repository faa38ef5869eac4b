"""fused_matmul_add_relu: ``relu(lhs @ rhs + bias)`` in one op, on CPU and CUDA, with autograd and
torch.compile support, and ``FusedLinearReLU``, a drop-in for ``nn.Linear`` followed by ``nn.ReLU``.

CUDA runs one cuBLASLt matmul whose epilogue adds the bias and applies the ReLU: a vector bias
through ``CUBLASLT_EPILOGUE_RELU_BIAS``, a bias of the output's shape as cuBLASLt's C matrix
(``D = relu(A @ B + C)``). fp16/bf16 accumulate in fp32. float32 follows torch's TF32 setting
(``torch.backends.cuda.matmul.allow_tf32``, read at each call, as torch.mm does). The CPU runs
ATen's GEMM and one fused bias + ReLU pass. NaN: the CPU keeps it, as torch.relu does; on CUDA it is
whatever cuBLASLt's ReLU epilogue makes of it (not pinned down by a test).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from opbuilder.dispatch.router import ROUTES as _ROUTES
from opbuilder.ops._checks import FLOAT_DTYPES, check_float, check_same
from opbuilder.torchop import eager, fakes, sharding
from opbuilder.torchop.inline import inline
from opbuilder.torchop.lazy import LazyOps
from opbuilder.torchop.once import refuse_forward_ad

if TYPE_CHECKING:
    from opbuilder.dispatch.record import Cost, Record, Shape

_OP = "fused_matmul_add_relu"
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
_AUTOCAST = torch._C._is_any_autocast_enabled
_ANY_REQUIRES_GRAD = torch._C._any_requires_grad


def _out_shape(lhs_shape: torch.Size, rhs_shape: torch.Size) -> list[int]:
    """[M, N], or [B, M, N] when either input is batched (a batch of 1 broadcasts)."""
    m, n = lhs_shape[-2], rhs_shape[-1]
    if len(lhs_shape) == 2 and len(rhs_shape) == 2:
        return [m, n]
    bl = lhs_shape[0] if len(lhs_shape) == 3 else 1
    br = rhs_shape[0] if len(rhs_shape) == 3 else 1
    return [br if bl == 1 else bl, m, n]


def _sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the dims that were broadcast to make it from ``shape``."""
    return grad if grad.shape == shape else grad.sum_to_size(shape)


def _grad_lhs(grad_pre: torch.Tensor, lhs_shape: torch.Size, rhs: torch.Tensor) -> torch.Tensor:
    return _sum_to(torch.matmul(grad_pre, rhs.mT), lhs_shape)


def _transposed(rhs: torch.Tensor) -> bool:
    """Whether rhs is a transposed view (the layer's weight.t()): a gradient of the same layout is what
    accumulates into the weight without a copy."""
    return rhs.stride(-2) == 1 and rhs.stride(-1) != 1


def _grad_rhs(grad_pre: torch.Tensor, lhs: torch.Tensor, rhs_shape: torch.Size, rhs_transposed: bool) -> torch.Tensor:
    """rhs's gradient from lhs, rhs's shape and whether rhs is transposed (rhs itself is not kept where lhs
    needs no gradient)."""
    if len(rhs_shape) == 3 and (rhs_shape[0] != 1 or (lhs.dim() == 3 and lhs.shape[0] == 1)):
        # A batch of rhs's own, or lhs's batch of one against rhs's: batched GEMMs (a batch of one flattened
        # would be a view DTensor refuses where that dim is split across ranks).
        return _sum_to(torch.matmul(lhs.mT, grad_pre), rhs_shape)
    # One rhs shared by every batch entry: the sum over the batch is one GEMM over all rows. The 2-D case is
    # not reshaped (as the C++ path): DTensor refuses to view an empty lhs split on its rows. flatten, not
    # reshape(-1, K): that refuses a tensor of 0 elements where K (or N) is 0.
    lhs2, grad2 = (lhs, grad_pre) if grad_pre.dim() == 2 else (lhs.flatten(0, -2), grad_pre.flatten(0, -2))
    if rhs_transposed:
        grad = (grad2.mT @ lhs2).mT
    else:
        grad = lhs2.mT @ grad2
    return grad.reshape(rhs_shape)


def _register(ns: str) -> None:
    # The fakes are the Meta kernels too: a call mixing the meta device with another comes to them, not to
    # the other device's kernel and its checks, so they check the devices (the function's usual path
    # leaves the checks to the op). They check the shapes too: DTensor gives them the whole shapes, and the
    # op then checks only each rank's piece, where a bias or batch that fits no whole output may fit.
    # .nograd: the forward without an autograd formula, for calls that record no gradient (opbuilder.torchop.eager).
    @fakes.register_fake(f"{ns}::{_OP}.nograd")
    @fakes.register_fake(f"{ns}::{_OP}")
    def _(lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        _check_devices(lhs, rhs, bias)
        _check_traced_shapes(lhs, rhs, bias)
        return lhs.new_empty(_out_shape(lhs.shape, rhs.shape))

    def setup_context(ctx, inputs, output) -> None:
        lhs, rhs, bias = inputs
        # As aten's addmm (and the C++ path): lhs kept only where rhs needs a gradient, rhs only where lhs does
        # (a frozen weight does not keep the layer's input alive); their shapes always.
        need = ctx.needs_input_grad
        ctx.save_for_backward(lhs if need[1] else None, rhs if need[0] else None, output)
        ctx.lhs_shape, ctx.rhs_shape, ctx.rhs_transposed = lhs.shape, rhs.shape, _transposed(rhs)
        ctx.bias_shape = None if bias is None else bias.shape

    @fakes.register_fake(f"{ns}::relu_bias_backward")
    def _(grad: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (grad.dim() != 2 or out.shape != grad.shape or out.dtype != grad.dtype or out.device != grad.device
                or grad.dtype not in FLOAT_DTYPES):
            _check_relu_bias(grad, out)
        return grad.new_empty(grad.shape), grad.new_empty(grad.shape[1:])

    lib = getattr(torch.ops, ns)

    def backward(ctx, grad: torch.Tensor):
        lhs, rhs, out = ctx.saved_tensors
        want_bias = ctx.bias_shape is not None and ctx.needs_input_grad[2]
        grad_bias = None
        if (want_bias and len(ctx.bias_shape) == 1 and grad.dim() == 2 and ctx.bias_shape[0] == grad.shape[1]
                and not torch.is_grad_enabled() and _one_pass(grad, out)):
            # relu's mask and the bias's gradient in one pass (the C++ path's choice, kernels/autograd).
            grad_pre, grad_bias = lib.relu_bias_backward.default(grad, out)
        else:
            # relu's mask from the saved output (out > 0), in one pass, as aten's relu backward does.
            grad_pre = torch.ops.aten.threshold_backward(grad, out, 0)
            if want_bias:
                grad_bias = _sum_to(grad_pre, ctx.bias_shape)
        grad_lhs = _grad_lhs(grad_pre, ctx.lhs_shape, rhs) if ctx.needs_input_grad[0] else None
        grad_rhs = _grad_rhs(grad_pre, lhs, ctx.rhs_shape, ctx.rhs_transposed) if ctx.needs_input_grad[1] else None
        return grad_lhs, grad_rhs, grad_bias

    eager.register_autograd(f"{ns}::{_OP}", backward, setup_context=setup_context)

    # DTensor: mm/bmm's rules (split B, M or N; the bias like the output); K is not split, as the ReLU
    # cannot be applied to partial sums.
    sharding.matmul(getattr(getattr(torch.ops, ns), _OP).default)
    sharding.matmul(getattr(getattr(torch.ops, ns), _OP).nograd)
    sharding.custom(lib.relu_bias_backward.default, _relu_bias_rule)


def _relu_bias_rule(grad, out):
    """DTensor's choices for relu_bias_backward ``(grad, out) -> (grad_pre, grad_bias)``: grad_pre is
    elementwise and grad_bias a sum over rows, so rows split (dim 0) give a Partial bias gradient and columns
    split (dim 1, a column-parallel layer's output) a split one; the op is linear in grad, which may come
    Partial with out whole. As the norms' rules, a split the inputs already have is followed, never moved."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    placements = [p for t in (grad, out) for p in t.placements]
    dims = {p.dim for p in placements if isinstance(p, Shard)} & {0, 1}
    if any(isinstance(p, Partial) for p in placements):
        dims = {0, 1}
    rules = [([Replicate(), Replicate()], [Replicate(), Replicate()])]
    rules += [([Shard(d), Partial() if d == 0 else Shard(0)], [Shard(d), Shard(d)]) for d in sorted(dims)]
    return rules + [([Partial(), Partial()], [Partial(), Replicate()])]


_ops = LazyOps(_OP, _register)


def fused_matmul_add_relu_op() -> torch._ops.OpOverload:
    """The loaded Torch op (``torch.ops.opb_fused_matmul_add_relu_<key>.fused_matmul_add_relu.default``)."""
    return _ops().fused_matmul_add_relu.default


def _wrapped(t: torch.Tensor) -> bool:
    """Whether a vmap wraps ``t``: functorch's, or the legacy one of ``autograd.grad(is_grads_batched=True)``."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._C._functorch.is_legacy_batchedtensor(t)


def _one_pass(grad: torch.Tensor, out: torch.Tensor) -> bool:
    """Where the backward takes relu_bias_backward's one pass, as the C++ path's ``one_pass``
    (kernels/fused_matmul_add_relu/fused_matmul_add_relu_autograd.h says why): CUDA, contiguous, plain
    tensors (no subclass, nothing a vmap wraps), rows of at least 256 bytes."""
    return (grad.is_cuda and type(grad) is torch.Tensor and type(out) is torch.Tensor and grad.shape == out.shape
            and grad.shape[1] * grad.element_size() >= 256 and grad.is_contiguous() and out.is_contiguous()
            and not _wrapped(grad) and not _wrapped(out))


def relu_bias_backward_op() -> torch._ops.OpOverload:
    """The loaded backward op ``(grad, out) -> (grad_pre, grad_bias)`` of the 2-D case: ``grad_pre =
    threshold_backward(grad, out, 0)``, ``grad_bias = grad_pre.sum(0)``, in one pass; builds on first use."""
    return _ops().relu_bias_backward.default


def _check_relu_bias(grad: torch.Tensor, out: torch.Tensor) -> None:
    """The op's own checks, for its fake (shapes and devices a meta call would not catch)."""
    name = "relu_bias_backward"
    check_float(name, "grad", grad)
    if grad.dim() != 2:
        raise ValueError(f"{name}: grad must be 2-D [M, N], got shape {list(grad.shape)}")
    if out.dtype != grad.dtype:
        raise TypeError(f"{name}: out must have grad's dtype {grad.dtype}, got {out.dtype}")
    if out.device != grad.device:
        raise ValueError(f"{name}: out must be on grad's device {grad.device}, got {out.device}")
    if out.shape != grad.shape:
        raise ValueError(f"{name}: out must have grad's shape {list(grad.shape)}, got {list(out.shape)}")


def _check_devices(lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The named error where rhs or bias is on another device than lhs (see the fakes)."""
    if rhs.device != lhs.device or (bias is not None and bias.device != lhs.device):
        _check_floats(lhs, rhs, bias)
        _check_same_and_shapes(lhs, rhs, bias)


def _autocast(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Under torch.autocast, the inputs in autocast's dtype, as torch.matmul would take them."""
    device = tensors[0].device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return [t.to(dtype) if t is not None and t.dtype in _AUTOCAST_ELIGIBLE else t for t in tensors]


def _check_shapes(lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None) -> None:
    if lhs.dim() == 2 and rhs.dim() == 2 and lhs.shape[1] == rhs.shape[0]:
        # The linear layer's case in a few reads (it is on every call's path); anything else below.
        if bias is None or (bias.dim() == 1 and bias.shape[0] in (1, rhs.shape[1])):
            return
    if lhs.dim() not in (2, 3):
        raise ValueError(f"{_OP}: lhs must be 2-D [M, K] or 3-D [B, M, K], got shape {list(lhs.shape)}")
    if rhs.dim() not in (2, 3):
        raise ValueError(f"{_OP}: rhs must be 2-D [K, N] or 3-D [B, K, N], got shape {list(rhs.shape)}")
    k = lhs.shape[-1]
    if rhs.shape[-2] != k:
        raise ValueError(
            f"{_OP}: rhs must have K={k} rows to match lhs's last dim, got {rhs.shape[-2]} (rhs shape {list(rhs.shape)})"
        )
    bl = lhs.shape[0] if lhs.dim() == 3 else 1
    br = rhs.shape[0] if rhs.dim() == 3 else 1
    if bl != br and bl != 1 and br != 1:
        raise ValueError(f"{_OP}: the batch dims of lhs and rhs must be equal or 1, got {bl} (lhs) and {br} (rhs)")
    if bias is not None:
        out = _out_shape(lhs.shape, rhs.shape)
        ok = bias.dim() <= len(out) and all(b in (o, 1) for b, o in zip(reversed(bias.shape), reversed(out)))
        if not ok:
            raise ValueError(
                f"{_OP}: bias must broadcast to the output's shape {out} (e.g. [N]=[{out[-1]}], [M, N] or the "
                f"full shape), got {list(bias.shape)}"
            )


def _check_traced_shapes(lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None) -> None:
    """_check_shapes in the fakes, where a size may be known only at run time (unbacked: ``x[x > 0]`` under
    torch.compile): a comparison that would have to guard on one is left to the op, which checks the real sizes."""
    try:
        _check_shapes(lhs, rhs, bias)
    except RuntimeError as exc:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # imports sympy: only here

        if not isinstance(exc, GuardOnDataDependentSymNode):
            raise


def fused_matmul_add_relu(lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(lhs @ rhs + bias)``.

    lhs: [M, K] or [B, M, K]; rhs: [K, N] or [B, K, N] (batch dims equal, or 1 to broadcast);
    bias: broadcastable to the output [M, N] / [B, M, N] ([N] is the common case), or None.
    float32/float16/bfloat16 (float64 too, for gradcheck), all on one device. Returns a new contiguous
    tensor; transposed views (e.g. ``weight.t()``) are read in place on CUDA.
    """
    direct = eager.direct()
    if direct and type(lhs) is torch.Tensor and not _AUTOCAST() and _OP not in _ROUTES:
        # The usual call. The C++ op checks every input (as _check does); only where it refuses them does
        # _check run, to raise the named TypeError/ValueError (reading each input first costs 1-2 us a call).
        op = _ops.eager().fused_matmul_add_relu
        try:
            if torch.is_grad_enabled() and _ANY_REQUIRES_GRAD(lhs, rhs, bias):
                return op.grad(lhs, rhs, bias)
            return op.nograd(lhs, rhs, bias)
        except (RuntimeError, TypeError) as exc:
            error = exc
        _check_floats(lhs, rhs, bias)  # outside the handler: a named error does not chain the op's
        _check_same_and_shapes(lhs, rhs, bias)
        raise error
    _check_floats(lhs, rhs, bias)
    if _AUTOCAST():
        lhs, rhs, bias = _autocast([lhs, rhs, bias])
    _check_same_and_shapes(lhs, rhs, bias)
    if _OP in _ROUTES and (y := _ROUTES[_OP](lhs, rhs, bias)) is not None:  # a trace's choice, or a fallback
        return y
    if direct:
        op = _ops.eager().fused_matmul_add_relu
        return (op.grad if eager.needs_grad(lhs, rhs, bias) else op.nograd)(lhs, rhs, bias)
    if inline(lhs):  # a small call under torch.compile: as nn.Linear and nn.ReLU compile
        if bias is not None and lhs.dim() == 2 and rhs.dim() == 2:
            return torch.relu(torch.addmm(bias, lhs, rhs)).contiguous()  # bias added before rounding, as ours
        return reference(lhs, rhs, bias).contiguous()  # as the kernel's output
    refuse_forward_ad(_OP, lhs, rhs, bias)
    return fused_matmul_add_relu_op()(lhs, rhs, bias)


def _check_floats(lhs: object, rhs: object, bias: object) -> None:
    check_float(_OP, "lhs", lhs)
    check_float(_OP, "rhs", rhs)
    if bias is not None:
        check_float(_OP, "bias", bias)


def _check_same_and_shapes(lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_same(_OP, "lhs", lhs, "rhs", rhs)
    if bias is not None:
        check_same(_OP, "lhs", lhs, "bias", bias)
    _check_shapes(lhs, rhs, bias)


class FusedLinearReLU(nn.Module):
    """``relu(x @ weight.T + bias)``: a drop-in for ``nn.Sequential(nn.Linear(...), nn.ReLU())``.

    Same initialisation as ``nn.Linear`` (same random draws for the same seed) and the same
    state_dict keys: ``weight`` [out_features, in_features], ``bias`` [out_features].
    x: [..., in_features] -> [..., out_features].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's: kaiming_uniform(a=sqrt(5)) gives U(-1/sqrt(in), 1/sqrt(in)); the bias the same bound.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is torch.Tensor and x.dtype == self.weight.dtype and x.dim() == 2 \
                and x.shape[1] == self.in_features:
            # The usual call, in a few reads (it is on every step's path): the op checks the rest.
            return fused_matmul_add_relu(x, self.weight.t(), self.bias)
        check_float("FusedLinearReLU", "x", x)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"FusedLinearReLU: x must have in_features={self.in_features} as its last dim, got shape {list(x.shape)}"
            )
        y = fused_matmul_add_relu(x.reshape(-1, self.in_features), self.weight.t(), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# ---- the record: what the checks, dispatch, the benchmark and the tests know of this op ----------------

def reference(lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.relu(lhs @ rhs if bias is None else lhs @ rhs + bias)


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    from opbuilder.dispatch.record import randn

    # BxMxKxN: lhs [B, M, K], rhs [B, K, N], bias [B, M, N].  MxKxN: lhs [M, K], rhs [K, N], bias [N].
    # lhs is scaled by 1/sqrt(K) so that the product and the bias are of one size and ReLU cuts about half.
    if len(shape) == 4:
        b, m, k, n = shape
        lhs_shape, rhs_shape, bias_shape = (b, m, k), (b, k, n), (b, m, n)
    else:
        m, k, n = shape
        lhs_shape, rhs_shape, bias_shape = (m, k), (k, n), (n,)
    return [randn(lhs_shape, dtype, device, gen, scale=k**-0.5), randn(rhs_shape, dtype, device, gen),
            randn(bias_shape, dtype, device, gen)]


def _extras(shape: Shape) -> dict:
    extras = {"matmul alone": lambda lhs, rhs, bias: lhs @ rhs}
    if len(shape) == 4:
        extras["baddbmm+relu_"] = lambda lhs, rhs, bias: torch.baddbmm(bias, lhs, rhs).relu_()
    else:
        extras["_addmm_activation"] = lambda lhs, rhs, bias: torch._addmm_activation(bias, lhs, rhs)
    return extras


def _cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    from opbuilder.dispatch.record import Cost

    b, m, k, n = shape if len(shape) == 4 else (1, *shape)
    return Cost(flops=(6 if with_backward else 2) * b * m * k * n)


_BF16 = torch.bfloat16

def record() -> Record:
    """This op's record; made at its first use (``opbuilder.jit.registry.record``): importing the op
    and calling it need none of it."""
    from opbuilder.dispatch.record import Bench, Host, Record, TensorSpec, Workload, Workloads

    return Record(
        name=_OP,
        function=fused_matmul_add_relu,
        axes=("M", "K", "N"),
        inputs={"lhs": TensorSpec(("...", "M", "K")), "rhs": TensorSpec(("...", "K", "N")), "bias": TensorSpec(("...", "N"))},
        outputs={"y": TensorSpec(("...", "M", "N"))},
        reference=reference,
        make_inputs=_inputs,
        reduction=lambda shape: shape[-2],  # K
        edges=(Workload("one row", (1, 64, 48), edge=True), Workload("odd widths", (7, 111, 13), edge=True),
               Workload("empty", (0, 64, 48), edge=True)),
        workloads=Workloads(cpu=(((1, 4096, 4096, 4096), torch.float32),),
                            cuda=(((1, 4096, 4096, 4096), _BF16), ((8, 2048, 2048, 2048), _BF16), ((4096, 4096, 4096), _BF16)),
                            cuda_backward=(((1, 4096, 4096, 4096), _BF16),), host=(4, 4, 4)),
        bench=Bench(
            ranks=(3, 4),
            shape_help="BxMxKxN (batched, full-shape bias [B, M, N]) or MxKxN (2-D, vector bias [N])",
            call_ours=lambda f: f,
            cost=_cost,
            cost_model="FLOPs 2 x B x M x N x K (the add and ReLU are not counted)",
            cost_model_backward="FLOPs 6 x B x M x N x K (forward, grad_lhs, grad_rhs)",
            extras=_extras,
        ),
        host=Host("torch.relu(a @ b + c)", lambda a, b, c: torch.relu(a @ b + c), 1.0, op="fused_matmul_add_relu_op"),
    )
