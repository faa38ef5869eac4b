"""One record per built-in op: everything known about it, declared once, beside its public function.

Each ``opbuilder/ops/<op>.py`` ends with ``def record() -> Record``, made at its first use
(``opbuilder.jit.registry.record``; importing and calling the op need none of it): the op's signature (axes, inputs,
outputs), its float64-checkable reference, its tolerances (a per-dtype table, widened with the reduction's
length), its workloads (the shapes checked and timed on each device, and the host-overhead shape), its
public function, and what the benchmark shows beside it (the least a call must cost, other eager
formulations, the PyTorch call it replaces on the host). ``opbuilder.jit.registry`` lists the records;
the definitions that check and dispatch use (``opbuilder.dispatch.definitions``), the benchmark and its
host-overhead table (``opbuilder.tools.bench``) and the tests all read them, never the reverse.

Needs torch (dtypes, input makers); imports nothing else of opbuilder but the definitions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from opbuilder.dispatch.definitions import TOLERANCES, Definition, MakeInputs, Shape, TensorSpec, Workload, edge_workloads

Fn = Callable[..., Any]
Case = tuple[Shape, torch.dtype]


@dataclass(frozen=True)
class Cost:
    """The least one call must move through memory (bytes read + written) or compute (FLOPs)."""

    bytes: int | None = None
    flops: int | None = None


@dataclass(frozen=True)
class Workloads:
    """The shapes an op is checked and timed on: per device (forward; forward and backward on CUDA), and
    the tiny shape of the host-overhead measure (16 elements)."""

    cpu: tuple[Case, ...]
    cuda: tuple[Case, ...]
    cuda_backward: tuple[Case, ...]
    host: Shape


@dataclass(frozen=True)
class Bench:
    """How ``opbuilder bench`` shows the op."""

    #: Accepted numbers of dims in a shape on the command line, and how to write one.
    ranks: tuple[int, ...]
    shape_help: str
    #: Turns the public function into a callable taking exactly the tensors ``make_inputs`` makes.
    call_ours: Callable[[Fn], Fn]
    #: (shape, bytes per element, with backward) -> the least one call (or forward+backward step) costs.
    cost: Callable[[Shape, int, bool], Cost]
    cost_model: str
    cost_model_backward: str
    #: shape -> other eager formulations, timed forward only (e.g. the matmul alone: the ceiling).
    extras: Callable[[Shape], dict[str, Fn]] = field(default=lambda shape: {})


@dataclass(frozen=True)
class Host:
    """The host-overhead measure (``benchmarks/host_overhead.py``): what ours is held against on tiny
    inputs, the most it may cost as a multiple of that, and the getters (in the op's module) of the
    registered op a plain call and a call recording a gradient reach."""

    torch_name: str
    torch_fn: Fn
    #: the most a forward call may cost, as a multiple of the torch call(s)
    limit: float
    op: str
    grad_op: str | None = None
    #: scalars appended to the tensors when calling the registered op (eps)
    extra: tuple = ()
    #: whether the registered op returns more than the function (LayerNorm's mean and rstd): take the first
    first: bool = False
    grad_first: bool = False
    #: the most a forward and backward may cost, as a multiple of the torch call(s)' (a fused op: no more than
    #: the unfused sequence)
    step_limit: float = 1.0


@dataclass(frozen=True)
class Record:
    """A built-in op: signature, reference, tolerances, workloads, public function, benchmark facts."""

    name: str
    function: Fn
    axes: tuple[str, ...]
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    #: What the op computes, with the op's own arguments and defaults; float64 inputs give the float64
    #: reference every implementation is checked against. ``torch.compile`` of it is an implementation too.
    reference: Fn
    #: (shape, dtype, device, generator) -> the op's tensor arguments: random, never zeros.
    make_inputs: MakeInputs
    workloads: Workloads
    bench: Bench
    host: Host
    #: shape -> the length of the longest sum making one output element: tolerances grow with its root.
    reduction: Callable[[Shape], int] = field(default=lambda shape: 1)
    #: (rtol, atol) per input dtype against the float64 reference, before the reduction's widening.
    tolerances: dict[torch.dtype, tuple[float, float]] = field(default_factory=lambda: dict(TOLERANCES))
    #: Edge shapes (one row, odd widths, empty); None: those of an op whose first axis counts rows.
    edges: tuple[Workload, ...] | None = None

    def definition(self) -> Definition:
        """The op's definition, as check and dispatch use it: the record's workloads named by shape."""
        named = tuple(
            Workload("x".join(str(s) for s in shape), shape, dtype, device)
            for device, cases in (("cpu", self.workloads.cpu), ("cuda", self.workloads.cuda))
            for shape, dtype in cases
        )
        return Definition(
            name=self.name, axes=self.axes, inputs=self.inputs, outputs=self.outputs, reference=self.reference,
            workloads=named, edges=self.edges if self.edges is not None else edge_workloads(self.axes, 1024),
            make_inputs=self.make_inputs, reduction=self.reduction, tolerances=self.tolerances,
        )


# ---- input makers the records share ----------------------------------------------------------------


def randn(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Normal random numbers made in float32 (the same values for every dtype), then cast."""
    t = torch.randn(shape, dtype=torch.float32, device=device, generator=gen)
    return (t * scale if scale != 1.0 else t).to(dtype)


def rows_hidden(*, params: int) -> MakeInputs:
    """``x: [rows, hidden]`` and ``params`` vectors ``[hidden]``."""

    def make(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list:
        hidden = shape[-1]
        return [randn(shape, dtype, device, gen)] + [randn((hidden,), dtype, device, gen) for _ in range(params)]

    return make
