"""The explicit list of built-in ops, which load, prebuild, report and the tests all walk."""

from __future__ import annotations

from opbuilder.builder import OpBuilder
from opbuilder.builders.relu import ReluBuilder
from opbuilder.errors import UnknownOpError

BUILDERS: dict[str, type[OpBuilder]] = {
    cls.NAME: cls
    for cls in (ReluBuilder,)
}

_INSTANCES: dict[str, OpBuilder] = {}


def names() -> list[str]:
    return list(BUILDERS)


def get_builder(name: str) -> OpBuilder:
    """The builder of a built-in op; an unknown name raises UnknownOpError listing the known ones."""
    if name not in BUILDERS:
        raise UnknownOpError(f"no built-in op named {name!r}; known ops: {', '.join(BUILDERS)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = BUILDERS[name]()
    return _INSTANCES[name]
