"""What the benchmark knows about each op, declared once: how to make its inputs for a shape, the eager
reference (which ``torch.compile`` also compiles), how to call ours, the least one call must cost, the
shapes timed by default, and any extra eager formulations worth showing beside them.

The references take the op's own arguments with the op's defaults (``eps``, ``dim``), so the same function
is the reference of the op's definition (``opbuilder.dispatch.definitions``: checks and dispatch) and the bench's eager.

Shapes are written ``AxB`` on the command line. Every op except the matmul takes ``ROWSxHIDDEN`` and works
on the last dim. ``fused_matmul_add_relu`` takes ``BxMxKxN`` (batched, bias of the output's full shape
``[B, M, N]``) or ``MxKxN`` (2-D, bias a vector ``[N]``: the linear layer's form).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

Shape = tuple[int, ...]
Inputs = list[torch.Tensor]
Fn = Callable[..., object]
MakeInputs = Callable[[Shape, torch.dtype, torch.device, torch.Generator], Inputs]

RMS_EPS = 1e-6
LN_EPS = 1e-5

BF16, FP32 = torch.bfloat16, torch.float32


@dataclass(frozen=True)
class Cost:
    """The least one call must move through memory (bytes read + written) or compute (FLOPs)."""

    bytes: int | None = None
    flops: int | None = None


@dataclass(frozen=True)
class OpSpec:
    name: str
    #: Where our function lives; imported only when the op is benchmarked.
    module: str
    function: str
    #: Accepted numbers of dims in a shape, and how to write one.
    ranks: tuple[int, ...]
    shape_help: str
    make_inputs: MakeInputs
    #: The eager reference; ``torch.compile`` compiles this same function.
    eager: Fn
    #: Turns our function into a callable taking exactly the tensors from ``make_inputs``.
    call_ours: Callable[[Fn], Fn]
    #: (shape, bytes per element, backward) -> the least one call (or one forward+backward step) costs.
    cost: Callable[[Shape, int, bool], Cost]
    cost_model: str
    cost_model_backward: str
    cuda_cases: tuple[tuple[Shape, torch.dtype], ...]
    cuda_backward_cases: tuple[tuple[Shape, torch.dtype], ...]
    cpu_cases: tuple[tuple[Shape, torch.dtype], ...]
    #: shape -> other eager formulations, timed forward only (e.g. the matmul alone: the ceiling).
    extras: Callable[[Shape], dict[str, Fn]] = field(default=lambda shape: {})

    def check_shape(self, shape: Shape) -> None:
        if len(shape) not in self.ranks:
            raise ValueError(f"{self.name}: a shape must be {self.shape_help}, got {format_shape(shape)}")


# ---- shapes and dtypes on the command line --------------------------------------------------------

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}


def parse_shape(text: str) -> Shape:
    parts = text.lower().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shapes: expected positive sizes joined by 'x' such as 4096x4096, got {text!r}")
    return tuple(int(p) for p in parts)


def parse_dtype(text: str) -> torch.dtype:
    if text.lower() not in DTYPES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {text!r}")
    return DTYPES[text.lower()]


def format_shape(shape: Shape) -> str:
    return "x".join(str(s) for s in shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- inputs: random, never zeros --------------------------------------------------------------------


def _randn(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    t = torch.randn(shape, dtype=torch.float32, device=device, generator=gen)
    return (t * scale if scale != 1.0 else t).to(dtype)


def _rows_hidden(*, params: int) -> MakeInputs:
    """``x: [rows, hidden]`` (plus a second one for the residual when asked) and ``params`` vectors ``[hidden]``."""

    def make(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Inputs:
        hidden = shape[-1]
        return [_randn(shape, dtype, device, gen)] + [_randn((hidden,), dtype, device, gen) for _ in range(params)]

    return make


def _add_rmsnorm_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Inputs:
    # input, residual: [rows, hidden]; weight: [hidden]
    return [_randn(shape, dtype, device, gen), _randn(shape, dtype, device, gen), _randn(shape[-1:], dtype, device, gen)]


def _matmul_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Inputs:
    # BxMxKxN: lhs [B, M, K], rhs [B, K, N], bias [B, M, N].  MxKxN: lhs [M, K], rhs [K, N], bias [N].
    # lhs is scaled by 1/sqrt(K) so that the product and the bias are of one size and ReLU cuts about half.
    if len(shape) == 4:
        b, m, k, n = shape
        lhs_shape, rhs_shape, bias_shape = (b, m, k), (b, k, n), (b, m, n)
    else:
        m, k, n = shape
        lhs_shape, rhs_shape, bias_shape = (m, k), (k, n), (n,)
    return [
        _randn(lhs_shape, dtype, device, gen, scale=k**-0.5),
        _randn(rhs_shape, dtype, device, gen),
        _randn(bias_shape, dtype, device, gen),
    ]


# ---- eager references --------------------------------------------------------------------------------


def eager_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def eager_add_rmsnorm(
    inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = RMS_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's meaning: ``residual_out = input + residual`` in their dtype, then the norm of it in float32
    (float64 for float64 inputs), rounded once to the input's dtype."""
    h = inp + residual
    hf = h.double() if h.dtype == torch.float64 else h.float()
    out = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(hf.dtype)
    return out.to(inp.dtype), h


def eager_add_rmsnorm_native(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in the input's dtype throughout (FlashInfer-Bench's reference): fewer casts, less exact."""
    h = inp + residual
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight, h


def eager_add_then_rms_norm(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = inp + residual
    return F.rms_norm(h, (h.shape[-1],), weight, RMS_EPS), h


def eager_relu_layernorm(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = LN_EPS
) -> torch.Tensor:
    return F.layer_norm(F.relu(x), (x.shape[-1],), weight, bias, eps)


def eager_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim)


def eager_matmul_add_relu(lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.relu(lhs @ rhs if bias is None else lhs @ rhs + bias)


def _matmul_extras(shape: Shape) -> dict[str, Fn]:
    extras: dict[str, Fn] = {"matmul alone": lambda lhs, rhs, bias: lhs @ rhs}
    if len(shape) == 4:
        extras["baddbmm+relu_"] = lambda lhs, rhs, bias: torch.baddbmm(bias, lhs, rhs).relu_()
    else:
        extras["_addmm_activation"] = lambda lhs, rhs, bias: torch._addmm_activation(bias, lhs, rhs)
    return extras


def _add_rmsnorm_extras(shape: Shape) -> dict[str, Fn]:
    extras: dict[str, Fn] = {"eager, input-dtype math": eager_add_rmsnorm_native}
    if hasattr(F, "rms_norm"):
        extras["add, F.rms_norm"] = eager_add_then_rms_norm
    return extras


# ---- cost models ---------------------------------------------------------------------------------------


def _elementwise_cost(forward: int, backward: int) -> Callable[[Shape, int, bool], Cost]:
    """``forward`` (or ``forward + backward``) full-size tensors read or written per call."""

    def cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
        n = math.prod(shape)
        return Cost(bytes=(forward + (backward if with_backward else 0)) * n * elem)

    return cost


def _relu_cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    n = math.prod(shape)
    return Cost(bytes=4 * n * elem + (n + 3) // 4 if with_backward else 2 * n * elem)


def _add_rmsnorm_cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    n, hidden = math.prod(shape), shape[-1]
    if not with_backward:
        return Cost(bytes=(4 * n + hidden) * elem)
    return Cost(bytes=(8 * n + 3 * hidden) * elem)


def _relu_layernorm_cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    n, hidden = math.prod(shape), shape[-1]
    if not with_backward:
        return Cost(bytes=(2 * n + 2 * hidden) * elem)
    return Cost(bytes=(5 * n + 5 * hidden) * elem)


def _matmul_cost(shape: Shape, elem: int, with_backward: bool) -> Cost:
    b, m, k, n = shape if len(shape) == 4 else (1, *shape)
    return Cost(flops=(6 if with_backward else 2) * b * m * k * n)


# ---- the specs ---------------------------------------------------------------------------------------

_ROWS_HIDDEN = "ROWSxHIDDEN (2 dims)"

SPECS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            name="relu",
            module="opbuilder.ops.relu",
            function="relu",
            ranks=(1, 2, 3, 4),
            shape_help="any shape, e.g. ROWSxCOLS",
            make_inputs=_rows_hidden(params=0),
            eager=eager_relu,
            call_ours=lambda f: f,
            cost=_relu_cost,
            cost_model="read x, write y: 2 x numel x bytes",
            cost_model_backward=(
                "forward reads x, writes y and 1 bit per element (the sign, all the backward needs); backward reads "
                "grad_y and the bits, writes grad_x: 4 x numel x bytes + numel / 4"
            ),
            cuda_cases=(((32768, 8192), FP32),),
            cuda_backward_cases=(((32768, 8192), FP32),),
            cpu_cases=(((4096, 4096), FP32),),
        ),
        OpSpec(
            name="fused_add_rmsnorm",
            module="opbuilder.ops.fused_add_rmsnorm",
            function="fused_add_rmsnorm",
            ranks=(2,),
            shape_help=_ROWS_HIDDEN,
            make_inputs=_add_rmsnorm_inputs,
            eager=eager_add_rmsnorm,
            call_ours=lambda f: lambda inp, residual, weight: f(inp, residual, weight, RMS_EPS),
            cost=_add_rmsnorm_cost,
            cost_model="read input, residual, weight; write out, residual_out: (4 x rows x hidden + hidden) x bytes",
            cost_model_backward=(
                "forward 4; backward reads grad_out, grad_residual_out, residual_out, writes one grad for input and "
                "residual (they are equal): (8 x rows x hidden + 3 x hidden) x bytes"
            ),
            cuda_cases=(((32768, 4096), BF16), ((4096, 4096), BF16), ((128, 4096), BF16)),
            cuda_backward_cases=(((32768, 4096), BF16),),
            cpu_cases=(((4096, 4096), FP32),),
            extras=_add_rmsnorm_extras,
        ),
        OpSpec(
            name="fused_relu_layernorm",
            module="opbuilder.ops.fused_relu_layernorm",
            function="fused_relu_layernorm",
            ranks=(2,),
            shape_help=_ROWS_HIDDEN,
            make_inputs=_rows_hidden(params=2),
            eager=eager_relu_layernorm,
            call_ours=lambda f: lambda x, weight, bias: f(x, weight, bias, LN_EPS),
            cost=_relu_layernorm_cost,
            cost_model="read x, weight, bias; write y: (2 x rows x hidden + 2 x hidden) x bytes",
            cost_model_backward=(
                "forward 2; backward reads grad_y, x, weight, writes grad_x, grad_weight, grad_bias: "
                "(5 x rows x hidden + 5 x hidden) x bytes"
            ),
            cuda_cases=(((32768, 4096), BF16), ((4096, 768), BF16)),
            cuda_backward_cases=(((32768, 4096), BF16),),
            cpu_cases=(((4096, 4096), FP32),),
        ),
        OpSpec(
            name="softmax",
            module="opbuilder.ops.softmax",
            function="softmax",
            ranks=(2,),
            shape_help=_ROWS_HIDDEN,
            make_inputs=_rows_hidden(params=0),
            eager=eager_softmax,
            call_ours=lambda f: lambda x: f(x, dim=-1),
            cost=_elementwise_cost(2, 3),
            cost_model="read x, write y: 2 x rows x hidden x bytes",
            cost_model_backward="forward 2; backward reads grad_y and y, writes grad_x: 5 x rows x hidden x bytes",
            cuda_cases=(
                ((4096, 4096), FP32), ((4096, 4096), BF16), ((16384, 32768), FP32), ((16384, 32768), BF16),
            ),
            cuda_backward_cases=(((32768, 4096), BF16),),
            cpu_cases=(((4096, 4096), FP32),),
        ),
        OpSpec(
            name="fused_matmul_add_relu",
            module="opbuilder.ops.fused_matmul_add_relu",
            function="fused_matmul_add_relu",
            ranks=(3, 4),
            shape_help="BxMxKxN (batched, full-shape bias [B, M, N]) or MxKxN (2-D, vector bias [N])",
            make_inputs=_matmul_inputs,
            eager=eager_matmul_add_relu,
            call_ours=lambda f: f,
            cost=_matmul_cost,
            cost_model="FLOPs 2 x B x M x N x K (the add and ReLU are not counted)",
            cost_model_backward="FLOPs 6 x B x M x N x K (forward, grad_lhs, grad_rhs)",
            cuda_cases=(((1, 4096, 4096, 4096), BF16), ((8, 2048, 2048, 2048), BF16), ((4096, 4096, 4096), BF16)),
            cuda_backward_cases=(((1, 4096, 4096, 4096), BF16),),
            cpu_cases=(((1, 4096, 4096, 4096), FP32),),
            extras=_matmul_extras,
        ),
    )
}
