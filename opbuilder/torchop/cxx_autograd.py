"""The built-in ops' gradients recorded in C++ (``kernels/autograd/``), as aten records its own.

The ops are built on the LibTorch stable ABI, which has no autograd API, so a Python
``autograd.Function`` records each call that needs a gradient: a Python frame in the forward and another
in the backward, about as much host time as the whole aten call it replaces. The glue library
(``AutogradGlueBuilder``) is built with torch's classic headers, so once a torch version (its key carries
the exact torch: a torch upgrade builds a new one and never loads the old); ``bind(op, ns)`` adds to a loaded
op's namespace a ``<op>.grad`` overload whose Autograd kernel is a C++ Node, as aten's generated ones are.
A call that needs a gradient is then one call into C++, and the backward runs no Python.

When: the first call that records a gradient asks for the glue (``entry``). Built already (the cache, or
``opbuilder build --all``), it is loaded then, in milliseconds. If not, a child process builds it in the
background (about 15 s of CPU, once a torch version) while the calls take the Python path, and the
calls switch once it is there; a process whose ops are never differentiated never builds it, and the first
call of an op without a gradient never waits for it. A child process, not a thread: the build finishes
and is kept for the next process even when this one ends first. Where the glue cannot be built or bound
(no compiler, ``OPB_CXX_AUTOGRAD=0``), gradients keep the Python path, with one warning saying why.

The registered ops (``ns::relu``, ``ns::forward``, ...: what a trace, a ``torch.compile`` graph, DTensor and
``torch.ops`` calls reach) get the same C++ Nodes as their Autograd kernels (``registered``) when their
formulas are first needed (``eager.register_queued``) and the glue is loaded or in the cache; otherwise (its
first build is still to come) their Python formulas, for the process's life. A compiled graph runs its ops
with grad mode off: through a C++ Autograd kernel that is one check and the op, where a Python one costs a
frame, a pytree walk and a redispatch on every call.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from opbuilder import env
from opbuilder.errors import FallbackWarning

_POLL_SECONDS = 0.25  # how often a call asks whether the background build has finished

_state = "new"  # new -> building -> ready | off
_namespace: str | None = None  # the glue's torch.ops namespace, once loaded
_build: subprocess.Popen | None = None
_build_log: Any = None
_next_poll = 0.0
_bound: dict[tuple[str, str], bool] = {}
_lock = threading.RLock()  # first gradients recorded by several threads at once start one build


def _builder() -> Any:
    from opbuilder.builders.autograd import AutogradGlueBuilder

    return AutogradGlueBuilder()


def _off(reason: str) -> None:
    global _state
    _state = "off"
    warnings.warn(f"opbuilder: the built-in ops' gradients take the Python path (slower on the host): {reason}",
                  FallbackWarning, stacklevel=5)


def load(wait: bool = True, build: bool = True) -> bool:
    """Load the glue, building it first if needed: in this process when ``wait``, else in a child process in
    the background; with ``build=False`` only from the cache (or a background build already finished).
    Returns whether it is loaded now. Never raises: a glue that cannot be had turns the C++ path off with
    one warning."""
    if _state in ("ready", "off"):
        return _state == "ready"
    with _lock:
        return _load(wait, build)


def _load(wait: bool, build: bool = True) -> bool:
    global _state, _namespace, _build, _build_log, _next_poll
    if _state in ("ready", "off"):
        return _state == "ready"
    if not env.cxx_autograd():
        _state = "off"  # asked for: no warning
        return False
    from opbuilder.jit import loader

    builder = _builder()
    try:
        if _state == "new":
            handle, _ = loader.load_cached(builder.name, builder.key)
            if handle is None and wait:
                handle = builder.load()
            if handle is not None:
                _namespace, _state = handle.name, "ready"
                return True
            if not build:
                return False
            reasons = builder.incompatibility_reasons()
            if reasons:
                _off("; ".join(reasons))
                return False
            _build_log = tempfile.TemporaryFile()
            _build = subprocess.Popen([sys.executable, "-m", "opbuilder.torchop.cxx_autograd"], stdin=subprocess.DEVNULL,
                                      stdout=_build_log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                      start_new_session=True)
            _state, _next_poll = "building", time.monotonic() + _POLL_SECONDS
            return False
        # building
        now = time.monotonic()
        if now < _next_poll and not wait:
            return False
        _next_poll = now + _POLL_SECONDS
        if wait:
            _build.wait()
        elif _build.poll() is None:
            return False
        if _build.returncode != 0:
            _build_log.seek(0)
            lines = [line for line in _build_log.read().decode(errors="replace").splitlines() if line.strip()]
            _off(f"building its C++ glue failed: {lines[-1] if lines else f'exit status {_build.returncode}'}")
            return False
        handle, _ = loader.load_cached(builder.name, builder.key)
        if handle is None:
            _off("its C++ glue was built but is not in the cache")
            return False
        _namespace, _state = handle.name, "ready"
        return True
    except Exception as exc:  # noqa: BLE001 (the Python path is always there: never fail a training step)
        _off(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return False


def entry(op: str, namespace: str, name: str) -> Callable[..., Any] | None:
    """The C callable of ``namespace::name.grad`` (the built-in op ``op``'s call recorded in C++), or None
    while the glue is not there (being built, or off): the caller then takes the Python path."""
    if _state != "ready" and not load(wait=False):
        return None
    key = (op, namespace)
    with _lock:
        if key not in _bound:
            _bind(op, namespace, key)
    if not _bound[key]:
        return None
    return getattr(getattr(torch.ops, namespace), name).grad._op


def registered(op: str, namespace: str) -> frozenset[str]:
    """Give the built-in op ``op``'s registered overloads (loaded as ``namespace``: ``ns::relu``, ...) their C++
    Autograd kernels, in place of the Python formulas of ``ops/<op>.py``; returns the names covered
    ("ns::relu", ...), whose formulas need not be registered with torch. Empty while the glue is neither
    loaded nor in the cache: this never starts its build (a first recorded gradient does, ``entry``), so a
    process that only traces or runs inference builds nothing."""
    if _state != "ready" and not load(wait=False, build=False):
        return frozenset()
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes():
            names = getattr(torch.ops, _namespace).bind_registered(op, namespace)
    except Exception as exc:  # noqa: BLE001 (the Python formulas are there: never fail a call)
        warnings.warn(f"opbuilder: {op}'s registered op takes its Python autograd formula: binding its C++ kernel "
                      f"failed: {str(exc).splitlines()[0]}", FallbackWarning, stacklevel=5)
        return frozenset()
    return frozenset(f"{namespace}::{name}" for name in names)


def _bind(op: str, namespace: str, key: tuple[str, str]) -> None:
    """Bind the glue to one loaded op's namespace; a failure leaves that op on the Python path, with a warning."""
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes():  # a registration, not a computation: no dispatch mode should see it
            getattr(torch.ops, _namespace).bind(op, namespace)
        _bound[key] = True
    except Exception as exc:  # noqa: BLE001 (as in load)
        _bound[key] = False
        warnings.warn(f"opbuilder: {op}'s gradients take the Python path: binding its C++ gradient failed: "
                      f"{str(exc).splitlines()[0]}", FallbackWarning, stacklevel=5)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside, the built-in ops' gradients take the Python path (as with ``OPB_CXX_AUTOGRAD=0``); after, the
    C++ path again where it was there. For comparing the two paths (tests, benchmarks)."""
    global _state
    before = _state
    _state = "off"
    _reset_eager_ops()
    try:
        yield
    finally:
        _state = before
        _reset_eager_ops()


#: Called when the gradient path switches (``disabled``): ``opbuilder.torchop.lazy`` registers the forgetting of
#: the ops' eager entries here, so that this module, which the eager path asks, imports neither.
_ON_SWITCH: list[Callable[[], None]] = []


def on_switch(hook: Callable[[], None]) -> None:
    _ON_SWITCH.append(hook)


def _reset_eager_ops() -> None:
    # The ops' eager entries bound their grad call on first use: forget it, so the next call asks again.
    for hook in _ON_SWITCH:
        hook()


def state() -> str:
    """``new``, ``building``, ``ready`` or ``off``: where this process's C++ gradient path stands."""
    return _state


if __name__ == "__main__":  # the background build (load(wait=False)): build into the cache, say why not
    try:
        _builder().load()
    except Exception as exc:  # noqa: BLE001
        print(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        sys.exit(1)
