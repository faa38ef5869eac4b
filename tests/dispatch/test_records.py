"""One record per built-in op (opbuilder.dispatch.record): every op the registry lists has a complete one, and
the definitions, the benchmark and the host-overhead table read it rather than keeping copies."""

from __future__ import annotations

import importlib

import pytest
import torch

from opbuilder.dispatch import definitions
from opbuilder.dispatch.record import Record
from opbuilder.jit import registry
from opbuilder.tools.bench import host, specs

OPS = registry.names()


@pytest.mark.parametrize("op", OPS)
def test_every_registered_op_has_a_complete_record(op: str) -> None:
    record = registry.record(op)
    module = importlib.import_module(registry.RECORD_MODULE.format(op=op))
    assert isinstance(record, Record) and record.name == op
    assert record.function is getattr(module, op), "the record names the op's public function"
    # signature: named tensors over the record's axes ("..." for any leading dims)
    assert record.inputs and record.outputs
    for spec in (*record.inputs.values(), *record.outputs.values()):
        assert set(spec.shape) <= set(record.axes) | {"..."}, spec
    # tolerances for every dtype the ops take
    assert set(record.tolerances) >= {torch.float32, torch.float16, torch.bfloat16, torch.float64}
    # workloads on both devices, the host measure's shape, each one the benchmark accepts
    cases = record.workloads
    assert cases.cpu and cases.cuda and cases.cuda_backward and cases.host
    for shape, _dtype in cases.cpu + cases.cuda + cases.cuda_backward:
        specs.SPECS[op].check_shape(shape)
    # the getters the host-overhead measure calls, in the op's own module
    assert callable(getattr(module, record.host.op))
    assert record.host.grad_op is None or callable(getattr(module, record.host.grad_op))
    # inputs for an edge shape, one tensor per named input, which the float64 reference takes
    definition = record.definition()
    odd = next(w for w in definition.edges if w.name == "odd widths")
    gen = torch.Generator().manual_seed(0)
    inputs = record.make_inputs(odd.shape, torch.float64, torch.device("cpu"), gen)
    assert len(inputs) == len(record.inputs)
    for tensor, spec in zip(inputs, record.inputs.values()):
        assert "..." in spec.shape or tensor.dim() == len(spec.shape), (spec, tensor.shape)
    out = record.reference(*inputs)
    assert len(out if isinstance(out, tuple) else (out,)) == len(record.outputs)


@pytest.mark.parametrize("op", OPS)
def test_definitions_benchmark_and_host_table_read_the_record(op: str) -> None:
    record = registry.record(op)
    definition = definitions.get(op)
    assert definition.reference is record.reference and definition.make_inputs is record.make_inputs
    assert [w.shape for w in definition.workloads] == [s for s, _ in record.workloads.cpu + record.workloads.cuda]
    assert definition.tolerance((4, 4), torch.float16) >= record.tolerances[torch.float16]
    spec = specs.SPECS[op]
    assert spec.eager is record.reference and spec.cpu_cases == record.workloads.cpu
    assert spec.cost is record.bench.cost and spec.extras is record.bench.extras
    assert host.HOST_CASES[op].shape == record.workloads.host
    assert host.HOST_CASES[op].torch_fn is record.host.torch_fn


def test_an_unknown_op_has_no_record() -> None:
    with pytest.raises(KeyError, match="known ops: relu"):
        registry.record("no_such_op")
