"""``torch.jit.trace``'s tracer paused: what must not be recorded by a trace, or must read a traced call's sizes as
numbers (the glue's registration calls, the router's choice of bucket), runs with this thread's tracing state
cleared and put back after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """This thread's tracing state cleared for the block; nothing changes where no trace is being recorded."""
    state = torch._C._get_tracing_state()
    if state is None:
        yield
        return
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)
