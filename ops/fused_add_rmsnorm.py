"""fused_add_rmsnorm: ``h = input + residual; out = h * rsqrt(mean(h^2, -1) + eps) * weight``, returning
``(out, h)``, on CPU and CUDA, with autograd (a C++ backward op) and torch.compile support; and
``rms_norm``, the same norm without a residual.

Numerics: h is rounded to the input dtype (it *is* ``residual_out``) and the norm is taken of that
rounded h, with fp32 accumulation (fp64 for float64 inputs). So ``out == rms_norm(residual_out)``, as
in an unfused model that adds in its own dtype and then normalises, and the next layer's residual is
exactly the tensor that was normalised. Outputs are contiguous, shaped like ``input``.

Backward: ``grad_input == grad_residual``, and ``grad_weight``, summed over rows in a fixed order
(deterministic run to run). Inside a model (input and residual made by earlier ops) one tensor serves as
both input gradients. When both are leaves, autograd would clone a shared tensor for the second ``.grad``
(a read and a write of it), so the kernel writes the two tensors itself (a write only).

Layers: ``FusedAddRMSNorm`` (Llama-style ``(normed, new_residual) = norm(x, residual)``) and
``RMSNorm``, with a ``weight`` parameter initialised to ones, as ``torch.nn.RMSNorm``. ``RMSNorm``
uses the ``rms_norm`` op (no zero residual is read, no residual_out written). The layers follow
PyTorch on dtypes: a weight of another dtype is cast to the input's, and under CUDA autocast, where
torch runs ``rms_norm`` in float32, fp16/bf16 inputs are normalised in float32 (the residual add stays in
the inputs' dtype, as ``x + residual`` would) -- two kernels instead of one. The functions themselves
take one dtype only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from opbuilder.dispatch.router import ROUTES as _ROUTES
from opbuilder.ops._checks import check_float, check_same
from opbuilder.torchop import eager, fakes, sharding
from opbuilder.torchop.inline import inline
from opbuilder.torchop.lazy import LazyOps
from opbuilder.torchop.once import once_differentiable, refuse_forward_ad, refuse_nested_grad

if TYPE_CHECKING:
    from opbuilder.dispatch.record import Cost, Record, Shape

#: The default eps (the Llama models').
EPS = 1e-6
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_ANY_REQUIRES_GRAD = torch._C._any_requires_grad
_ANY_AUTOCAST = torch._C._is_any_autocast_enabled


def _register(ns: str) -> None:
    lib = getattr(torch.ops, ns)

    # The fakes are the Meta kernels too: a call mixing the meta device with another comes to them, not to
    # the other device's kernel and its checks, so they check the devices (the functions' usual path leaves
    # the checks to the op).
    # The .nograd overloads are the forwards without an autograd formula, for calls that record no gradient
    # (opbuilder.torchop.eager): the same fakes.
    @fakes.register_fake(f"{ns}::fused_add_rmsnorm.nograd")
    @fakes.register_fake(f"{ns}::fused_add_rmsnorm")
    def _(input, residual, weight, eps):
        if residual.device != input.device or weight.device != input.device:
            _check_fused(input, residual, weight, eps)
        return input.new_empty(input.shape), input.new_empty(input.shape)

    @fakes.register_fake(f"{ns}::rms_norm.nograd")
    @fakes.register_fake(f"{ns}::rms_norm")
    def _(input, weight, eps):
        if weight.device != input.device:
            _check_rms(input, weight, eps)
        return input.new_empty(input.shape)

    @fakes.register_fake(f"{ns}::fused_add_rmsnorm_backward")
    def _(grad_out, grad_residual_out, residual_out, weight, eps):
        return residual_out.new_empty(residual_out.shape), weight.new_empty(weight.shape)

    @fakes.register_fake(f"{ns}::fused_add_rmsnorm_backward.two_grads")
    def _(grad_out, grad_residual_out, residual_out, weight, eps):
        return (residual_out.new_empty(residual_out.shape), residual_out.new_empty(residual_out.shape),
                weight.new_empty(weight.shape))

    def setup_fused(ctx, inputs, output) -> None:
        input, residual, weight, eps = inputs
        ctx.save_for_backward(output[1], weight)
        ctx.eps = eps
        ctx.leaf_inputs = input.is_leaf and residual.is_leaf
        # An output the loss does not use comes to the backward as None, not as zeros: autograd makes those
        # zeros a plain tensor even where the outputs are DTensors, which the backward op refuses beside them.
        ctx.set_materialize_grads(False)

    def only_residual_out(ctx, grad_out, grad_residual_out) -> bool:
        return grad_out is None

    def backward_fused(ctx, saved, grad_out, grad_residual_out):
        residual_out, weight = saved
        need = ctx.needs_input_grad
        if grad_out is None:
            # Only residual_out (input + residual) was used: its gradient is theirs, and the weight gets none,
            # as with torch's add and rms_norm (an optimizer skips a None gradient; it would step a zero one).
            return (grad_residual_out if need[0] else None, grad_residual_out if need[1] else None, None, None)
        if need[0] and need[1] and ctx.leaf_inputs:
            grad_input, grad_residual, grad_weight = lib.fused_add_rmsnorm_backward.two_grads(
                grad_out, grad_residual_out, residual_out, weight, ctx.eps
            )
        else:
            grad_input, grad_weight = lib.fused_add_rmsnorm_backward.default(
                grad_out, grad_residual_out, residual_out, weight, ctx.eps
            )
            grad_residual = grad_input
        return (
            grad_input if need[0] else None,
            grad_residual if need[1] else None,
            grad_weight if need[2] else None,
            None,
        )

    eager.register_autograd(f"{ns}::fused_add_rmsnorm",
                            once_differentiable("fused_add_rmsnorm", backward_fused, passthrough=only_residual_out),
                            setup_context=setup_fused)

    def setup_rms(ctx, inputs, output) -> None:
        input, weight, eps = inputs
        # A copy of an input made under inference_mode, which autograd refuses to save (as the C++ path).
        ctx.save_for_backward(input.clone() if input.is_inference() else input, weight)
        ctx.eps = eps

    def backward_rms(ctx, saved, grad_out):
        input, weight = saved
        grad_input, grad_weight = lib.fused_add_rmsnorm_backward.default(grad_out, None, input, weight, ctx.eps)
        need = ctx.needs_input_grad
        return grad_input if need[0] else None, grad_weight if need[1] else None, None

    eager.register_autograd(f"{ns}::rms_norm", once_differentiable("rms_norm", backward_rms), setup_context=setup_rms)

    # DTensor: rows split on any dim but the normalised last one, weight replicated; grad_weight sums over
    # the rows, so with rows split it is Partial (what makes sequence parallelism right); the backward is
    # linear in the incoming gradients.
    sharding.rowwise(lib.fused_add_rmsnorm.default, params=["weight"])
    sharding.rowwise(lib.rms_norm.default, params=["weight"])
    sharding.rowwise(lib.fused_add_rmsnorm.nograd, params=["weight"])
    sharding.rowwise(lib.rms_norm.nograd, params=["weight"])
    grads = ["grad_out", "grad_residual_out"]
    sharding.rowwise(lib.fused_add_rmsnorm_backward.default, params=["weight"], reduced=[1], linear=grads)
    sharding.rowwise(lib.fused_add_rmsnorm_backward.two_grads, params=["weight"], reduced=[2], linear=grads)


_ops = LazyOps("fused_add_rmsnorm", _register)


def fused_add_rmsnorm_op() -> torch._ops.OpOverload:
    """The loaded forward op; builds on first use."""
    return _ops().fused_add_rmsnorm.default


def fused_add_rmsnorm_backward_op() -> torch._ops.OpOverload:
    """The loaded backward op ``(grad_out, grad_residual_out?, residual_out, weight, eps) -> (grad_input,
    grad_weight)``; builds on first use."""
    return _ops().fused_add_rmsnorm_backward.default


def rms_norm_op() -> torch._ops.OpOverload:
    """The loaded residual-free forward op; builds on first use."""
    return _ops().rms_norm.default


# ---- checks -------------------------------------------------------------------------------------------


def _check_eps(op: str, eps: object) -> float:
    if type(eps) is not float:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"{op}: eps must be a float, got {type(eps).__name__}")
        eps = float(eps)
    if not 0.0 <= eps < math.inf:  # False for NaN too
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps}")
    return eps


def _check_input_and_weight(op: str, input: object, weight: object) -> None:
    check_float(op, "input", input)
    if input.dim() == 0:
        raise ValueError(f"{op}: input must have at least 1 dimension ([..., hidden]), got a 0-d tensor")
    check_float(op, "weight", weight)
    check_same(op, "input", input, "weight", weight)
    hidden = input.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"{op}: weight must have shape [{hidden}] to match input's last dim, got {list(weight.shape)}")


# ---- functions ----------------------------------------------------------------------------------------


def fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, residual_out)`` with ``residual_out = input + residual`` (in their dtype) and
    ``out = residual_out * rsqrt(mean(residual_out^2, -1) + eps) * weight`` (fp32 accumulation).

    input, residual: [..., hidden], one float dtype (float32, float16, bfloat16; float64 too), one device.
    weight: [hidden], same dtype and device. Non-contiguous inputs are accepted.
    """
    op = "fused_add_rmsnorm"
    direct = eager.direct()
    if direct and type(input) is torch.Tensor and type(eps) is float and op not in _ROUTES:
        # The usual call. The C++ op checks every input (as _check_fused does); only where it refuses them
        # does _check_fused run, to raise the named TypeError/ValueError (reading each input first costs
        # 1-2 us a call).
        fused = _ops.eager().fused_add_rmsnorm
        try:
            if torch.is_grad_enabled() and _ANY_REQUIRES_GRAD(input, residual, weight):
                return fused.grad(input, residual, weight, eps)
            return fused.nograd(input, residual, weight, eps)
        except (RuntimeError, TypeError) as exc:
            error = exc
        _check_fused(input, residual, weight, eps)  # outside the handler: a named error does not chain the op's
        raise error
    args = (input, residual, weight, _check_fused(input, residual, weight, eps))
    if op in _ROUTES and (out := _ROUTES[op](*args)) is not None:  # a trace's choice, or a fallback
        return out
    if direct:
        fused = _ops.eager().fused_add_rmsnorm
        return (fused.grad if eager.needs_grad(input, residual, weight) else fused.nograd)(*args)
    if inline(input):  # a small call under torch.compile: Inductor fuses the definition with its neighbours
        out, residual_out = reference(*args)
        return out.contiguous(), residual_out.contiguous()  # as the kernel's outputs
    refuse_nested_grad("fused_add_rmsnorm")
    refuse_forward_ad("fused_add_rmsnorm", *args[:3])
    return fused_add_rmsnorm_op()(*args)


def rms_norm(input: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``input * rsqrt(mean(input^2, -1) + eps) * weight`` (fp32 accumulation), like
    ``F.rms_norm(input, (hidden,), weight, eps)``. input: [..., hidden]; weight: [hidden], same dtype."""
    if eager.direct():
        norm = _ops.eager().rms_norm
        if type(input) is torch.Tensor and type(eps) is float:  # the usual call: the op checks, as above
            try:
                if torch.is_grad_enabled() and _ANY_REQUIRES_GRAD(input, weight):
                    return norm.grad(input, weight, eps)
                return norm.nograd(input, weight, eps)
            except (RuntimeError, TypeError) as exc:
                error = exc
            _check_rms(input, weight, eps)
            raise error
        args = (input, weight, _check_rms(input, weight, eps))
        return (norm.grad if eager.needs_grad(input, weight) else norm.nograd)(*args)
    eps = _check_rms(input, weight, eps)
    if inline(input):  # a small call under torch.compile: Inductor fuses the definition with its neighbours
        return _rms(input, weight, eps).contiguous()  # as the kernel's output
    refuse_nested_grad("rms_norm")
    refuse_forward_ad("rms_norm", input, weight)
    return rms_norm_op()(input, weight, eps)


def _check_fused(input: object, residual: object, weight: object, eps: object) -> float:
    """The named TypeError/ValueError for inputs fused_add_rmsnorm does not take; else eps as a float."""
    op = "fused_add_rmsnorm"
    _check_input_and_weight(op, input, weight)
    check_float(op, "residual", residual)
    check_same(op, "input", input, "residual", residual)
    if residual.shape != input.shape:
        raise ValueError(f"{op}: residual must have input's shape {list(input.shape)}, got {list(residual.shape)}")
    return _check_eps(op, eps)


def _check_rms(input: object, weight: object, eps: object) -> float:
    _check_input_and_weight("rms_norm", input, weight)
    return _check_eps("rms_norm", eps)


# ---- layers -------------------------------------------------------------------------------------------


def _autocast_casts_rms_norm(device_type: str) -> bool:
    """Whether this torch's autocast has a rule for ``aten::rms_norm`` on ``device_type``: the CUDA one
    lists it among its float32 ops (ATen autocast_mode.h, AT_FORALL_FP32); the CPU one leaves it alone."""
    key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device_type]
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", key)
    except (AttributeError, RuntimeError):
        return device_type == "cuda"


_AUTOCAST_FP32 = {device: _autocast_casts_rms_norm(device) for device in ("cpu", "cuda")}


def _norm_in_float32(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether torch would run ``rms_norm`` on ``dtype`` inputs in float32 here (autocast on, with a rule)."""
    device = x.device.type
    return dtype in _LOW_PRECISION and _AUTOCAST_FP32.get(device, False) and torch.is_autocast_enabled(device)


class _NormLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float = EPS, device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"{type(self).__name__}: hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = _check_eps(type(self).__name__, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class FusedAddRMSNorm(_NormLayer):
    """``forward(x, residual) -> (normed, new_residual)``: ``new_residual = x + residual`` and
    ``normed = RMSNorm(new_residual)``, in one pass (the pre-norm decoder step). State: ``weight`` [hidden]."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.weight
        if x.dtype is residual.dtype is weight.dtype and not _ANY_AUTOCAST():
            # The usual call, in a few reads (it is on every step's path): no cast to make, the op checks the rest.
            return fused_add_rmsnorm(x, residual, weight, self.eps)
        dtype = torch.promote_types(x.dtype, residual.dtype) if x.is_floating_point() else x.dtype
        if _norm_in_float32(x, dtype):
            new_residual = x + residual
            return rms_norm(new_residual.float(), self.weight.float(), self.eps), new_residual
        weight = self.weight.to(dtype) if x.is_floating_point() else self.weight
        return fused_add_rmsnorm(x.to(dtype), residual.to(dtype), weight, self.eps)


class RMSNorm(_NormLayer):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight``, like ``torch.nn.RMSNorm(hidden_size, eps)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype is weight.dtype and not _ANY_AUTOCAST():  # the usual call: no cast to make
            return rms_norm(x, weight, self.eps)
        if _norm_in_float32(x, x.dtype):
            return rms_norm(x.float(), self.weight.float(), self.eps)
        weight = self.weight.to(x.dtype) if x.is_floating_point() else self.weight
        return rms_norm(x, weight, self.eps)


# ---- the record: what the checks, dispatch, the benchmark and the tests know of this op ----------------

def reference(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
              eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's meaning: ``residual_out = input + residual`` in their dtype, then the norm of it in float32
    (float64 for float64 inputs), rounded once to the input's dtype."""
    h = input + residual
    return _rms(h, weight, eps), h


def _rms(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm's meaning: the norm of ``h`` in float32 (float64 for float64 inputs), rounded once to its dtype."""
    hf = h.double() if h.dtype == torch.float64 else h.float()
    out = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(hf.dtype)
    return out.to(h.dtype)


def _native(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in the input's dtype throughout (FlashInfer-Bench's reference): fewer casts, less exact."""
    h = input + residual
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight, h


def _unfused(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model without this op runs: the add, then ``F.rms_norm``."""
    h = input + residual
    return F.rms_norm(h, (h.shape[-1],), weight, EPS), h


def _extras(shape: Shape) -> dict:
    extras = {"eager, input-dtype math": _native}
    if hasattr(F, "rms_norm"):
        extras["add, F.rms_norm"] = _unfused
    return extras


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    from opbuilder.dispatch.record import randn

    # input, residual: [rows, hidden]; weight: [hidden]
    return [randn(shape, dtype, device, gen), randn(shape, dtype, device, gen), randn(shape[-1:], dtype, device, gen)]


def _cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    from opbuilder.dispatch.record import Cost

    n, hidden = math.prod(shape), shape[-1]
    return Cost(bytes=((8 * n + 3 * hidden) if with_backward else (4 * n + hidden)) * elem)


_ROWS = ("rows", "hidden")
_BF16 = torch.bfloat16

def record() -> Record:
    """This op's record; made at its first use (``opbuilder.jit.registry.record``): importing the op
    and calling it need none of it."""
    from opbuilder.dispatch.record import Bench, Host, Record, TensorSpec, Workloads

    return Record(
        name="fused_add_rmsnorm",
        function=fused_add_rmsnorm,
        axes=_ROWS,
        inputs={"input": TensorSpec(_ROWS), "residual": TensorSpec(_ROWS), "weight": TensorSpec(("hidden",))},
        outputs={"out": TensorSpec(_ROWS), "residual_out": TensorSpec(_ROWS)},
        reference=reference,
        make_inputs=_inputs,
        reduction=lambda shape: shape[-1],
        workloads=Workloads(cpu=(((4096, 4096), torch.float32),),
                            cuda=(((32768, 4096), _BF16), ((4096, 4096), _BF16), ((128, 4096), _BF16)),
                            cuda_backward=(((32768, 4096), _BF16),), host=(1, 16)),
        bench=Bench(
            ranks=(2,),
            shape_help="ROWSxHIDDEN (2 dims)",
            call_ours=lambda f: lambda input, residual, weight: f(input, residual, weight, EPS),
            cost=_cost,
            cost_model="read input, residual, weight; write out, residual_out: (4 x rows x hidden + hidden) x bytes",
            cost_model_backward=(
                "forward 4; backward reads grad_out, grad_residual_out, residual_out, writes one grad for input and "
                "residual (they are equal): (8 x rows x hidden + 3 x hidden) x bytes"
            ),
            extras=_extras,
        ),
        host=Host("x + r, F.rms_norm", _unfused, 1.0, op="fused_add_rmsnorm_op", extra=(EPS,)),
    )
