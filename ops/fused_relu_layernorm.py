"""fused_relu_layernorm: ``layer_norm(relu(x), weight, bias, eps)`` over the last dim, in one pass, on
CPU and CUDA, with a fused C++ backward, autograd and torch.compile support."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from opbuilder.dispatch.router import ROUTES as _ROUTES
from opbuilder.ops._checks import check_float, check_same, check_tensor
from opbuilder.torchop import eager, fakes, sharding
from opbuilder.torchop.inline import inline
from opbuilder.torchop.lazy import LazyOps
from opbuilder.torchop.once import once_differentiable, refuse_forward_ad, refuse_nested_grad

if TYPE_CHECKING:
    from opbuilder.dispatch.record import Cost, Record, Shape

_OP = "fused_relu_layernorm"
#: The default eps, torch.nn.LayerNorm's.
EPS = 1e-5
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_AUTOCAST = torch._C._is_any_autocast_enabled
_ANY_REQUIRES_GRAD = torch._C._any_requires_grad


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _register(ns: str) -> None:
    # The fakes are the Meta kernels too: a call mixing the meta device with another comes to them, not to
    # the other device's kernel and its checks, so they check the devices (fused_relu_layernorm's fast path
    # leaves the checks to the op).
    @fakes.register_fake(f"{ns}::fused_relu_layernorm")
    def _(x, weight, bias, eps):
        _check_devices(x, weight, bias, eps)
        stats = x.shape[:-1]
        return (
            torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(stats, dtype=_stats_dtype(x), device=x.device),
            torch.empty(stats, dtype=_stats_dtype(x), device=x.device),
        )

    # The forward without an autograd formula and without the statistics, for calls that record no
    # gradient (opbuilder.torchop.eager).
    @fakes.register_fake(f"{ns}::fused_relu_layernorm.nograd")
    def _(x, weight, bias, eps):
        _check_devices(x, weight, bias, eps)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @fakes.register_fake(f"{ns}::fused_relu_layernorm_backward")
    def _(grad_y, x, weight, mean, rstd, affine_grads):
        n = x.shape[-1] if affine_grads else 0
        return (
            torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty((n,), dtype=x.dtype, device=x.device),
            torch.empty((n,), dtype=x.dtype, device=x.device),
        )

    backward_op = getattr(getattr(torch.ops, ns), "fused_relu_layernorm_backward").default

    def setup_context(ctx, inputs, output) -> None:
        x, weight, _bias, _eps = inputs
        _y, mean, rstd = output
        # A copy of an x made under inference_mode, which autograd refuses to save (as the C++ path).
        ctx.save_for_backward(x.clone() if x.is_inference() else x, weight, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)

    def backward(ctx, saved, grad_y, _grad_mean, _grad_rstd):
        x, weight, mean, rstd = saved
        need_w, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_x, grad_w, grad_b = backward_op(grad_y, x, weight, mean, rstd, need_w or need_b)
        return grad_x, grad_w if need_w else None, grad_b if need_b else None, None

    eager.register_autograd(f"{ns}::fused_relu_layernorm", once_differentiable("fused_relu_layernorm", backward),
                            setup_context=setup_context)
    # The eager call with a gradient, until its C++ path is there: the Function, y alone.
    eager.register_python_grad(f"{ns}::fused_relu_layernorm",
                               lambda *args: _ops.eager().fused_relu_layernorm.apply(*args)[0])

    # DTensor: rows (and mean, rstd) split on any dim but the normalised last one, weight and bias replicated;
    # grad_weight and grad_bias sum over the rows (Partial when they are split); linear in grad_y.
    lib = getattr(torch.ops, ns)
    sharding.rowwise(lib.fused_relu_layernorm.default, params=["weight", "bias"])
    sharding.rowwise(lib.fused_relu_layernorm.nograd, params=["weight", "bias"])
    sharding.rowwise(lib.fused_relu_layernorm_backward.default, params=["weight"], reduced=[1, 2], linear=["grad_y"])


_ops = LazyOps(_OP, _register)


def fused_relu_layernorm_op() -> torch._ops.OpOverload:
    """The loaded forward op, ``(x, weight?, bias?, eps) -> (y, mean, rstd)``; builds on first use."""
    return _ops().fused_relu_layernorm.default


def fused_relu_layernorm_backward_op() -> torch._ops.OpOverload:
    """The loaded backward op, ``(grad_y, x, weight?, mean, rstd, affine_grads) -> (grad_x, grad_w, grad_b)``."""
    return _ops().fused_relu_layernorm_backward.default


def _check_param(arg: str, value: object, x: torch.Tensor) -> torch.Tensor | None:
    if value is None:
        return None
    t = check_tensor(_OP, arg, value)
    check_same(_OP, "x", x, arg, t)
    if t.dim() != 1 or t.shape[0] != x.shape[-1]:
        raise ValueError(f"{_OP}: {arg} must have shape [{x.shape[-1]}] to match x's last dim, got {list(t.shape)}")
    return t


def _autocast(x: torch.Tensor, weight, bias):
    """Inputs and output dtype as ``nn.LayerNorm(relu(x))`` would have them under autocast.

    CUDA autocast runs layer_norm in float32 (its float32 list): float16/bfloat16 inputs are cast up and
    the output is float32. CPU autocast leaves layer_norm alone, whose mixed-dtype kernel computes with
    float32 weights and returns x's dtype: we compute in float32 and cast back. Returns
    (x, weight, bias, dtype to cast y to or None).
    """
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias, None

    def up(t):
        return t.float() if t is not None and t.dtype in _LOW_PRECISION else t

    if device == "cpu":
        if all(t is None or t.dtype == x.dtype for t in (weight, bias)):
            return x, weight, bias, None
        return up(x), up(weight), up(bias), x.dtype
    return up(x), up(weight), up(bias), None


def fused_relu_layernorm(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = EPS
) -> torch.Tensor:
    """``layer_norm(relu(x), [hidden], weight, bias, eps)`` over x's last dim (hidden).

    x: [..., hidden], float32/float16/bfloat16 (float64 too), CPU or CUDA, any strides.
    weight, bias: [hidden] of x's dtype and device, or None. Statistics are accumulated in float32
    (float64 for float64 x). Returns y of x's shape and dtype (contiguous).
    """
    direct = eager.direct()
    if direct and type(x) is torch.Tensor and type(eps) is float and not _AUTOCAST() and _OP not in _ROUTES:
        # The usual call. The C++ op checks every input; only where it refuses them do the Python checks
        # run, to raise the named TypeError/ValueError (reading each input here first costs 1 us a call).
        op = _ops.eager().fused_relu_layernorm
        try:
            if torch.is_grad_enabled() and _ANY_REQUIRES_GRAD(x, weight, bias):
                # Contiguous here rather than in the op, so that the x saved for the backward is the copy.
                return op.grad(x.contiguous(), weight, bias, eps)
            return op.nograd(x, weight, bias, eps)  # the op makes x contiguous itself
        except (RuntimeError, TypeError) as exc:
            error = exc
        _check(x, weight, bias, eps)  # outside the handler: a named error does not chain the op's
        raise error
    out_dtype = None
    if _AUTOCAST():
        check_float(_OP, "x", x)
        x, weight, bias, out_dtype = _autocast(x, weight, bias)
    weight, bias, eps = _check(x, weight, bias, eps)
    if _OP in _ROUTES and (y := _ROUTES[_OP](x, weight, bias, eps)) is not None:  # a trace's choice, or a fallback
        return y if out_dtype is None else y.to(out_dtype)
    args = (x.contiguous(), weight, bias, eps)
    if direct:
        op = _ops.eager().fused_relu_layernorm
        y = op.grad(*args) if eager.needs_grad(x, weight, bias) else op.nograd(*args)
    elif inline(x):  # a small call under torch.compile: Inductor fuses the definition with its neighbours
        y = reference(x, weight, bias, eps).contiguous()  # as the kernel's output
    else:
        refuse_nested_grad(_OP)
        refuse_forward_ad(_OP, *args[:3])
        y = fused_relu_layernorm_op()(*args)[0]
    return y if out_dtype is None else y.to(out_dtype)


def _check_devices(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> None:
    """The named error where weight or bias is on another device than x (see the fakes)."""
    if (weight is not None and weight.device != x.device) or (bias is not None and bias.device != x.device):
        _check(x, weight, bias, eps)


def _check(x: object, weight: object, bias: object, eps: object) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """The named TypeError/ValueError for inputs the op does not take; else (weight, bias, eps as a float)."""
    check_float(_OP, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{_OP}: x must have at least 1 dimension (the normalized one), got a 0-d tensor")
    if type(eps) is not float and (not isinstance(eps, numbers.Real) or isinstance(eps, bool)):
        raise TypeError(f"{_OP}: eps must be a float, got {type(eps).__name__}")
    return _check_param("weight", weight, x), _check_param("bias", bias, x), float(eps)


class FusedReLULayerNorm(nn.Module):
    """``nn.LayerNorm(hidden_size)`` applied to ``relu(x)``, fused; same parameters and state_dict keys
    (``weight``, ``bias``; none when ``elementwise_affine=False``)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = EPS,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(hidden_size, numbers.Integral) or isinstance(hidden_size, bool) or hidden_size < 0:
            raise ValueError(f"FusedReLULayerNorm: hidden_size must be a non-negative int, got {hidden_size!r}")
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if (weight is not None and weight.dtype is not x.dtype and x.is_floating_point()
                and not torch.is_autocast_enabled(x.device.type)):
            # Parameters of another dtype (bfloat16 activations, float32 parameters), which nn.LayerNorm takes:
            # cast to x's, as RMSNorm does. Under autocast on x's device, the op's autocast rule casts instead.
            weight, bias = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
        return fused_relu_layernorm(x, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


# ---- the record: what the checks, dispatch, the benchmark and the tests know of this op ----------------

def reference(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              eps: float = EPS) -> torch.Tensor:
    return F.layer_norm(F.relu(x), (x.shape[-1],), weight, bias, eps)


def _cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    from opbuilder.dispatch.record import Cost

    n, hidden = math.prod(shape), shape[-1]
    return Cost(bytes=((5 * n + 5 * hidden) if with_backward else (2 * n + 2 * hidden)) * elem)


def _unfused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(torch.relu(x), (x.shape[-1],), weight, bias, EPS)


_ROWS = ("rows", "hidden")
_BF16 = torch.bfloat16

def record() -> Record:
    """This op's record; made at its first use (``opbuilder.jit.registry.record``): importing the op
    and calling it need none of it."""
    from opbuilder.dispatch.record import Bench, Host, Record, TensorSpec, Workloads, rows_hidden

    return Record(
        name=_OP,
        function=fused_relu_layernorm,
        axes=_ROWS,
        inputs={"x": TensorSpec(_ROWS), "weight": TensorSpec(("hidden",)), "bias": TensorSpec(("hidden",))},
        outputs={"y": TensorSpec(_ROWS)},
        reference=reference,
        make_inputs=rows_hidden(params=2),
        reduction=lambda shape: shape[-1],
        workloads=Workloads(cpu=(((4096, 4096), torch.float32),), cuda=(((32768, 4096), _BF16), ((4096, 768), _BF16)),
                            cuda_backward=(((32768, 4096), _BF16),), host=(1, 16)),
        bench=Bench(
            ranks=(2,),
            shape_help="ROWSxHIDDEN (2 dims)",
            call_ours=lambda f: lambda x, weight, bias: f(x, weight, bias, EPS),
            cost=_cost,
            cost_model="read x, weight, bias; write y: (2 x rows x hidden + 2 x hidden) x bytes",
            cost_model_backward=(
                "forward 2; backward reads grad_y, x, weight, writes grad_x, grad_weight, grad_bias: "
                "(5 x rows x hidden + 5 x hidden) x bytes"
            ),
        ),
        host=Host("F.layer_norm(torch.relu(x))", _unfused, 1.0, op="fused_relu_layernorm_op", extra=(EPS,), first=True),
    )
