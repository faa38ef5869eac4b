"""The explicit list of built-in ops, which load, prebuild, report and the tests all walk."""

from __future__ import annotations

import importlib

from opbuilder.errors import UnknownOpError
from opbuilder.jit.builder import OpBuilder

#: op name -> "module:Builder class". Imported on lookup, so naming an op costs nothing.
BUILDERS: dict[str, str] = {
    "relu": "opbuilder.builders.relu:ReluBuilder",
    "fused_add_rmsnorm": "opbuilder.builders.fused_add_rmsnorm:FusedAddRMSNormBuilder",
    "fused_relu_layernorm": "opbuilder.builders.fused_relu_layernorm:FusedReLULayerNormBuilder",
    "softmax": "opbuilder.builders.softmax:SoftmaxBuilder",
    "fused_matmul_add_relu": "opbuilder.builders.fused_matmul_add_relu:FusedMatmulAddReluBuilder",
}

_INSTANCES: dict[str, OpBuilder] = {}


def names() -> list[str]:
    return list(BUILDERS)


def builder_class(name: str) -> type[OpBuilder]:
    if name not in BUILDERS:
        raise UnknownOpError(f"no built-in op named {name!r}; known ops: {', '.join(BUILDERS)}")
    module, _, cls = BUILDERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_builder(name: str) -> OpBuilder:
    """The builder of a built-in op; an unknown name raises UnknownOpError listing the known ones."""
    if name not in _INSTANCES:
        _INSTANCES[name] = builder_class(name)()
    return _INSTANCES[name]
