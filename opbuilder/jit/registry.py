"""The explicit list of built-in ops, which load, prebuild, report and the tests all walk."""

from __future__ import annotations

import importlib
from typing import Any

from opbuilder.errors import UnknownOpError
from opbuilder.jit.builder import OpBuilder

#: Every built-in op, one line each: name -> (its builder, "module:Class"; the module of its public function,
#: layer and record, ``opbuilder.dispatch.record``). Imported on lookup, so naming an op costs nothing.
BUILTINS: dict[str, tuple[str, str]] = {
    "relu": ("opbuilder.builders.relu:ReluBuilder", "opbuilder.ops.relu"),
    "fused_add_rmsnorm": ("opbuilder.builders.fused_add_rmsnorm:FusedAddRMSNormBuilder", "opbuilder.ops.fused_add_rmsnorm"),
    "fused_relu_layernorm": ("opbuilder.builders.fused_relu_layernorm:FusedReLULayerNormBuilder",
                             "opbuilder.ops.fused_relu_layernorm"),
    "softmax": ("opbuilder.builders.softmax:SoftmaxBuilder", "opbuilder.ops.softmax"),
    "fused_matmul_add_relu": ("opbuilder.builders.fused_matmul_add_relu:FusedMatmulAddReluBuilder",
                              "opbuilder.ops.fused_matmul_add_relu"),
}

#: op name -> "module:Builder class".
BUILDERS: dict[str, str] = {name: builder for name, (builder, _module) in BUILTINS.items()}

_INSTANCES: dict[str, OpBuilder] = {}


def names() -> list[str]:
    return list(BUILDERS)


def _known(name: str) -> None:
    if name not in BUILTINS:
        raise UnknownOpError(f"no built-in op named {name!r}; known ops: {', '.join(BUILTINS)}")


def builder_class(name: str) -> type[OpBuilder]:
    _known(name)
    module, _, cls = BUILDERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_builder(name: str) -> OpBuilder:
    """The builder of a built-in op; an unknown name raises UnknownOpError listing the known ones."""
    if name not in _INSTANCES:
        _INSTANCES[name] = builder_class(name)()
    return _INSTANCES[name]


def record(name: str) -> Any:
    """The record of a built-in op (``RECORD`` of its module: an ``opbuilder.dispatch.record.Record``);
    imports the op's module (and torch). An unknown name raises UnknownOpError listing the known ones."""
    _known(name)
    return importlib.import_module(BUILTINS[name][1]).RECORD
