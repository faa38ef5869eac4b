"""Loading an op on its first call, and registering its fake and autograd once loaded.

An op's namespace carries its build key, so its fake and autograd registrations can only be made
after the load: each op's Python file passes a ``register(namespace)`` function that makes them.
Its Python autograd formulas reach torch (``torch.library.register_autograd``) only when something
calls the op through the dispatcher or records a gradient (``namespace_of``, ``eager.register_queued``):
the first call of an op used without gradients goes to the C++ op directly and needs none of them.

The first call may come inside ``torch.compile``: ``namespace_of`` is marked as having a constant
result (what ``torch.compiler.assume_constant_result`` does, without importing Dynamo at import
time, which would cost most of a second), so Dynamo runs it once while tracing and keeps the name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opbuilder.jit.builder import OpBuilder
from opbuilder.torchop import cxx_autograd, eager
from opbuilder.torchop.eager import EagerOps

_ENTRIES: dict[str, tuple[str | OpBuilder, Callable[[str], None]]] = {}
_INSTANCES: list["LazyOps"] = []
_NAMESPACES: dict[str, str] = {}


def loaded(entry: str) -> str:
    """The ``torch.ops`` namespace of a registered op, loaded (built if needed) and its ``register(namespace)``
    run: enough for the eager path's calls (``LazyOps.eager``), which go to the C++ ops directly."""
    name = _NAMESPACES.get(entry)
    if name is None:
        builder, register = _ENTRIES[entry]
        if isinstance(builder, str):
            from opbuilder.jit.registry import get_builder

            builder = get_builder(builder)
        handle = builder.load()
        name = handle.name
        register(name)
        _NAMESPACES[entry] = name
    return name


def namespace_of(entry: str) -> str:
    """``loaded(entry)``, its op's Python autograd formulas registered with torch too (``eager.register_queued``):
    the namespace for calls through the dispatcher (a trace, DTensor, a transform, a gradient)."""
    name = loaded(entry)
    eager.register_queued(name, entry if isinstance(_ENTRIES[entry][0], str) else None)
    return name


namespace_of._dynamo_marked_constant = True  # type: ignore[attr-defined]


class LazyOps:
    """``LazyOps(builder, register)()`` is the loaded ``torch.ops`` namespace of the builder's op.

    ``builder``: an ``OpBuilder`` (a user's op) or a built-in op's name. Nothing is built or loaded
    until the first call.
    """

    def __init__(self, builder: str | OpBuilder, register: Callable[[str], None]) -> None:
        self.entry = builder if isinstance(builder, str) else f"{type(builder).__module__}.{type(builder).__qualname__}"
        self._builtin = builder if isinstance(builder, str) else None
        _ENTRIES[self.entry] = (builder, register)
        self._eager: EagerOps | None = None
        _INSTANCES.append(self)

    def __call__(self) -> Any:
        return getattr(torch.ops, namespace_of(self.entry))

    def eager(self) -> EagerOps:
        """The loaded ops' direct entries for eager calls (``opbuilder.torchop.eager``), bound once: later calls
        cost one attribute read. Not for code Dynamo traces (use ``self()`` there)."""
        ops = self._eager
        if ops is None:
            ops = self._eager = EagerOps(getattr(torch.ops, loaded(self.entry)), self._builtin)
        return ops


def reset_eager() -> None:
    """Forget every op's bound eager entries (``LazyOps.eager``): the next call binds them again."""
    for ops in _INSTANCES:
        ops._eager = None


cxx_autograd.on_switch(reset_eager)
