"""What the benchmark knows about each op: a view of the op's record (``opbuilder.dispatch.record``, beside
its public function in ``opbuilder/ops/<op>.py``): how to make its inputs for a shape, the reference (which
``torch.compile`` also compiles), how to call ours, the least one call must cost, the shapes timed by
default, and any extra eager formulations worth showing beside them. The records are the one copy; this
module only reads them.

Shapes are written ``AxB`` on the command line. Every op except the matmul takes ``ROWSxHIDDEN`` and works
on the last dim. ``fused_matmul_add_relu`` takes ``BxMxKxN`` (batched, bias of the output's full shape
``[B, M, N]``) or ``MxKxN`` (2-D, bias a vector ``[N]``: the linear layer's form).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opbuilder.dispatch.record import Cost, Record, Shape
from opbuilder.jit import registry
from opbuilder.ops.fused_add_rmsnorm import EPS as RMS_EPS
from opbuilder.ops.fused_relu_layernorm import EPS as LN_EPS

Inputs = list[torch.Tensor]
Fn = Callable[..., object]

__all__ = ["DTYPES", "LN_EPS", "RMS_EPS", "SPECS", "Cost", "Fn", "Inputs", "OpSpec", "Shape", "dtype_name",
           "format_shape", "parse_dtype", "parse_shape"]


class OpSpec:
    """The benchmark's view of one op's record: the names its code reads (``SPECS[op]``)."""

    def __init__(self, record: Record) -> None:
        bench, cases = record.bench, record.workloads
        self.record, self.name = record, record.name
        #: where our function lives (imported when the op is benchmarked), and its name there
        self.module, self.function = record.function.__module__, record.function.__name__
        self.make_inputs, self.eager = record.make_inputs, record.reference
        self.ranks, self.shape_help, self.call_ours, self.extras = bench.ranks, bench.shape_help, bench.call_ours, bench.extras
        self.cost, self.cost_model, self.cost_model_backward = bench.cost, bench.cost_model, bench.cost_model_backward
        self.cpu_cases, self.cuda_cases, self.cuda_backward_cases = cases.cpu, cases.cuda, cases.cuda_backward

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


SPECS: dict[str, OpSpec] = {name: OpSpec(registry.record(name)) for name in registry.names()}
