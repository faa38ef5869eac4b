"""The explicit list of built-in ops, which load, prebuild, report and the tests all walk."""

from __future__ import annotations

import importlib
from typing import Any

from opbuilder.errors import UnknownOpError
from opbuilder.jit.builder import OpBuilder

#: Every built-in op, one line each: name -> its builder, "module:Class". Imported on lookup, so naming an op
#: costs nothing. The op's public function, layer and record (``opbuilder.dispatch.record``) are in
#: ``opbuilder.ops.<name>`` (``RECORD_MODULE``).
BUILDERS: dict[str, str] = {
    "relu": "opbuilder.builders.relu:ReluBuilder",
    "fused_add_rmsnorm": "opbuilder.builders.fused_add_rmsnorm:FusedAddRMSNormBuilder",
    "fused_relu_layernorm": "opbuilder.builders.fused_relu_layernorm:FusedReLULayerNormBuilder",
    "softmax": "opbuilder.builders.softmax:SoftmaxBuilder",
    "fused_matmul_add_relu": "opbuilder.builders.fused_matmul_add_relu:FusedMatmulAddReluBuilder",
}
RECORD_MODULE = "opbuilder.ops.{op}"

_INSTANCES: dict[str, OpBuilder] = {}


def names() -> list[str]:
    return list(BUILDERS)


def _known(name: str) -> None:
    if name not in BUILDERS:
        raise UnknownOpError(f"no built-in op named {name!r}; known ops: {', '.join(BUILDERS)}")


def builder_class(name: str) -> type[OpBuilder]:
    _known(name)
    module, _, cls = BUILDERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_builder(name: str) -> OpBuilder:
    """The builder of a built-in op; an unknown name raises UnknownOpError listing the known ones."""
    if name not in _INSTANCES:
        _INSTANCES[name] = builder_class(name)()
    return _INSTANCES[name]


_RECORDS: dict[str, Any] = {}


def record(name: str) -> Any:
    """The record of a built-in op (what ``record()`` of its module makes, once: an
    ``opbuilder.dispatch.record.Record``); imports the op's module (and torch). An unknown name raises
    UnknownOpError listing the known ones."""
    _known(name)
    if name not in _RECORDS:
        _RECORDS[name] = importlib.import_module(RECORD_MODULE.format(op=name)).record()
    return _RECORDS[name]
