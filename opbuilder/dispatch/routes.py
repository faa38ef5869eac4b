"""The table the built-in ops' public functions read on every call: op -> its router while the op is
routed (or not yet resolved). ``opbuilder.dispatch.router`` fills it and takes an op out once its calls
go straight to our compiled op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: Built-in op -> its ``Router``, while the op is routed (or not yet resolved).
ROUTES: dict[str, Any] = {}
#: Built-in ops whose implementations were listed or registered in code (``opbuilder.dispatch.implementations``):
#: their first call resolves through the whole table, not the direct path alone.
LISTED: set[str] = set()
#: The name of a built-in op's own compiled implementation, the first of its implementations.
COMPILED = "compiled"


@contextlib.contextmanager
def bypass(op: str) -> Iterator[None]:
    """Calls of the built-in ``op`` inside go straight to our compiled op (check and tune time it so)."""
    r = ROUTES.pop(op, None)
    try:
        yield
    finally:
        if r is not None:
            ROUTES[op] = r
