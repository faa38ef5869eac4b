"""Loading a built-in op on its first call, and registering its fake and autograd once loaded.

The op's namespace carries its build key, so the fake and autograd registrations can only be made
after the load; each op file passes a ``register(namespace)`` function that makes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opbuilder.registry import get_builder


class LazyOps:
    """``LazyOps("relu", register)()`` returns the loaded ``torch.ops`` namespace of op ``relu``."""

    def __init__(self, op: str, register: Callable[[str], None]) -> None:
        self.op = op
        self._register = register
        self._namespace: Any = None

    def __call__(self) -> Any:
        if self._namespace is None:
            builder = get_builder(self.op)
            namespace = builder.load()
            self._register(builder.namespace)
            self._namespace = namespace
        return self._namespace
