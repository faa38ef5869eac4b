"""Definitions: what an op computes, declared once -- its inputs (symbolic axes and dtypes), its outputs,
a PyTorch reference and a few named workloads -- so that every implementation of it can be checked
against the same reference on the same shapes (``opbuilder.dispatch.check``) and chosen at run time
(``opbuilder.dispatch.router``).

The built-in ops' definitions come from their records (``opbuilder.dispatch.record``: one beside each op's
public function in ``opbuilder/ops/<op>.py``), which the benchmark and the tests read too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from opbuilder.errors import UnknownOpError
from opbuilder.jit import registry

#: (rtol, atol) against a float64 evaluation of the reference, for outputs of an implementation that
#: accumulates in float32 from inputs of this dtype. The tests use the same table.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}

Shape = tuple[int, ...]
MakeInputs = Callable[[Shape, torch.dtype, torch.device, torch.Generator], list]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: its axes (names; ``...`` for any leading dims) and its dtype (``float`` for
    any of float32/float16/bfloat16/float64, the same for all the op's tensors)."""

    shape: tuple[str, ...]
    dtype: str = "float"


@dataclass(frozen=True)
class Workload:
    """A shape to check and time: ``shape`` gives the definition's ``axes`` in order. ``device``: the
    device type it is meant for (None: any); ``edge``: an edge case (one row, odd widths, empty)."""

    name: str
    shape: Shape
    dtype: torch.dtype = torch.float32
    device: str | None = None
    edge: bool = False


def _randn_inputs(inputs: dict[str, TensorSpec], axes: tuple[str, ...]) -> MakeInputs:
    """Random normal tensors shaped by each input's axes (a generic ``make_inputs``)."""

    def make(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list:
        sizes = dict(zip(axes, shape))
        return [
            torch.randn([sizes[a] for a in spec.shape], generator=gen, device=device).to(dtype)
            for spec in inputs.values()
        ]

    return make


def edge_workloads(axes: tuple[str, ...], width: int, dtype: torch.dtype = torch.float32) -> tuple[Workload, ...]:
    """One row, odd widths and an empty input for an op whose first axis counts rows."""
    rest = (width,) * (len(axes) - 1)
    return (
        Workload("one row", (1,) + rest, dtype, edge=True),
        Workload("odd widths", (7,) + (111,) * (len(axes) - 1), dtype, edge=True),
        Workload("empty", (0,) + rest, dtype, edge=True),
    )


@dataclass
class Definition:
    """An op: ``reference(*inputs, **defaults)`` is what every implementation must compute.

    ``reference`` and every implementation take the op's own arguments (the tensors named in ``inputs``
    first, then any scalars with their defaults). ``reduction(shape)`` is the length of the longest sum
    that makes one output element: the tolerance grows with its square root (float32 accumulation).
    """

    name: str
    axes: tuple[str, ...]
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    reference: Callable
    workloads: tuple[Workload, ...]
    edges: tuple[Workload, ...] | None = None
    make_inputs: MakeInputs | None = None
    reduction: Callable[[Shape], int] = field(default=lambda shape: 1)
    #: (rtol, atol) per input dtype, before the reduction's widening.
    tolerances: dict[torch.dtype, tuple[float, float]] = field(default_factory=lambda: dict(TOLERANCES))

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError(f"definition {self.name!r}: give at least one workload")
        for w in self.workloads + (self.edges or ()):
            if len(w.shape) != len(self.axes) and self.make_inputs is None:
                raise ValueError(
                    f"definition {self.name!r}: workload {w.name!r} must give {len(self.axes)} sizes "
                    f"({', '.join(self.axes)}), got {w.shape}"
                )
        if self.make_inputs is None:
            self.make_inputs = _randn_inputs(self.inputs, self.axes)
        if self.edges is None:
            first = self.workloads[0]
            width = first.shape[-1] if first.shape else 1
            self.edges = edge_workloads(self.axes, width, first.dtype)

    def workloads_for(self, device: torch.device) -> list[Workload]:
        """The named workloads meant for this device type, then the edge shapes in each of their dtypes."""
        named = [w for w in self.workloads if w.device in (None, device.type)]
        dtypes = list(dict.fromkeys(w.dtype for w in named)) or [torch.float32]
        edges = [Workload(e.name, e.shape, d, e.device, True) for d in dtypes for e in self.edges or ()]
        return named + edges

    def inputs_for(self, workload: Workload, device: torch.device, seed: int = 0) -> list:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return list(self.make_inputs(workload.shape, workload.dtype, device, gen))

    def tolerance(self, shape: Shape, dtype: torch.dtype) -> tuple[float, float]:
        rtol, atol = self.tolerances[dtype]
        scale = max(1.0, math.sqrt(max(self.reduction(shape), 1)) / 8)
        return rtol * scale, atol * scale


_DEFINITIONS: dict[str, Definition] = {}


def register(definition: Definition) -> Definition:
    """Make ``definition`` known by its name (a user's op; the built-in ones are known already)."""
    from opbuilder import paths

    paths.check_op_name(definition.name)  # its traces' folder, under the cache
    _DEFINITIONS[definition.name] = definition
    return definition


def get(name: str) -> Definition:
    """The definition of an op; an unknown name raises UnknownOpError listing the known ones."""
    if name not in _DEFINITIONS:
        if name not in registry.BUILDERS:
            known = sorted(set(_DEFINITIONS) | set(registry.BUILDERS))
            raise UnknownOpError(f"no op definition named {name!r}; known: {', '.join(known)}")
        _DEFINITIONS[name] = registry.record(name).definition()
    return _DEFINITIONS[name]
