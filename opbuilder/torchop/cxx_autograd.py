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
and is kept for the next process even when this one ends first; it imports the same opbuilder as this process
(its ``sys.path``, made absolute) and checks that it builds the glue this process asks for. While it runs, a
call asks whether it has finished at most every quarter second (one clock read otherwise). Where another
process already builds it (the ranks of a torchrun job on one node, all at their first gradient at once), no
child is started: the one that starts the build takes ``paths.build_starter``'s lock and hands it to its child,
which holds it until it exits; a process that finds it (or the build lock) held looks in the cache at the same
pace, and starts a build only if that one ends without the glue and without a failure (killed): a failure
recorded while it waited turns its C++ path off with that failure's warning. A process forked
meanwhile (a ``fork`` worker) does not own that child: it looks in the cache, and starts a build of its own
only when it needs one. Where the glue cannot be built or bound (no compiler), gradients keep the Python path,
with one warning saying why; with ``OPB_CXX_AUTOGRAD=0`` they keep it silently.

The registered ops (``ns::relu``, ``ns::forward``, ...: what a trace, a ``torch.compile`` graph, DTensor and
``torch.ops`` calls reach) get the same C++ Nodes as their Autograd kernels (``registered``) when their
formulas are first needed (``eager.register_queued``) and the glue is loaded or in the cache; otherwise (its
first build is still to come) their Python formulas, for the process's life. A compiled graph runs its ops
with grad mode off: through a C++ Autograd kernel that is one check and the op, where a Python one costs a
frame, a pytree walk and a redispatch on every call.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
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
from opbuilder.torchop.tracer import untraced

_POLL_SECONDS = 0.25  # how often a call asks whether the background build has finished

_state = "new"  # new -> building | waiting (another process builds it) -> ready | off
_namespace: str | None = None  # the glue's torch.ops namespace, once loaded
_build: subprocess.Popen | None = None
_build_log: Any = None
_next_poll = 0.0
_waiting_since = 0.0  # when this process began to wait for another process's build (time.time())
_starter_fd: int | None = None  # the starter lock, from its taking to its handing to the build child
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
    if (_state == "building" or _state == "waiting") and not wait and time.monotonic() < _next_poll:
        return False  # the background build was asked less than a poll ago: one clock read
    with _lock:
        return _load(wait, build)


#: The last line the background build prints when it fails starts with this; the warning shows the rest.
_ERROR_PREFIX = "opbuilder-glue-error: "


def _load(wait: bool, build: bool = True) -> bool:
    global _state, _namespace, _next_poll
    if _state in ("ready", "off"):
        return _state == "ready"
    try:
        if not env.cxx_autograd():
            _state = "off"  # asked for: no warning
            return False
        from opbuilder.jit import loader

        if _state == "new":
            builder = _builder()
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
            if _built_elsewhere(builder):
                _wait_elsewhere()
                return False
            _start_build(builder.key)
            return False
        now = time.monotonic()
        if now < _next_poll and not wait:
            return False
        _next_poll = now + _POLL_SECONDS
        if _state == "waiting":  # for another process's build
            builder = _builder()
            handle = builder.load() if wait else loader.load_cached(builder.name, builder.key)[0]
            if handle is not None:
                _namespace, _state = handle.name, "ready"
                return True
            if _built_elsewhere(builder):
                return False
            failure = _failed_while_waiting(builder)
            if failure is not None:
                _off(failure)
            elif build:  # it ended without the glue and said nothing (killed): ours now
                _start_build(builder.key)
            return False
        # building
        if wait:
            _build.wait()
        elif _build.poll() is None:
            return False
        failure = _build_failure()
        if failure is not None:
            _off(failure)
            return False
        builder = _builder()
        handle, _ = loader.load_cached(builder.name, builder.key)
        if handle is None:
            _off("its C++ glue was built but is not in the cache")
            return False
        _namespace, _state = handle.name, "ready"
        return True
    except Exception as exc:  # noqa: BLE001 (the Python path is always there: never fail a training step)
        _off(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return False


def _built_elsewhere(builder: Any) -> bool:
    """Whether another process builds the glue now: its background build (the starter lock) or a build in a
    process (the key's build lock). False where the locks cannot be asked (a build then says why, as before)."""
    from opbuilder import paths
    from opbuilder.jit.locks import FileLock, Timeout

    for path in (paths.build_starter(builder.name, builder.key), paths.lock(builder.name, builder.key)):
        lock = FileLock(path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return True
        except Exception:  # noqa: BLE001 (a cache this process cannot lock in: its own build reports it)
            return False
        lock.release()
    return False


def _wait_elsewhere() -> None:
    global _state, _next_poll, _waiting_since
    _state, _next_poll, _waiting_since = "waiting", time.monotonic() + _POLL_SECONDS, time.time()


def _failed_while_waiting(builder: Any) -> str | None:
    """Why the build this process waited for failed, from its failure record (None: no record written since this
    process began to wait: it was killed, or failed before). Each waiting rank starting a build of its own after a
    failure would build and fail again, one after the other."""
    from opbuilder.jit import cache

    failure = cache.read_failure(cache.Slot(builder.name, builder.key))
    if failure is None or failure["time"] is None or failure["time"] < _waiting_since:
        return None
    from opbuilder.errors import BuildError

    log = failure.get("log")
    line = _one_line(BuildError(failure["message"] + (f"\nfull log: {log}" if log else "")))
    return f"building its C++ glue failed: {line} (in process {failure.get('pid')}, while this one waited)"


def _start_build(key: str) -> None:
    """Start the background build of the glue whose key is ``key``: a child process that imports the opbuilder
    this process imported (``_child_path``), builds into the cache and refuses to build a glue of another key. A
    daemon thread waits for it, so that it never lingers as a zombie; at exit, a build still running is left to
    finish (for the next process) without a warning."""
    global _state, _build, _build_log, _next_poll, _starter_fd
    from opbuilder import paths
    from opbuilder.jit.locks import FileLock, Timeout

    lock = FileLock(paths.build_starter(_builder().name, key))
    try:
        lock.acquire(timeout=0)
        _starter_fd = lock.detach()  # for the child to hold until it exits (a fork meanwhile closes its copy)
    except Timeout:  # another process started one a moment ago: wait for it
        _wait_elsewhere()
        return
    except Exception:  # noqa: BLE001 (no lock there: the build itself says why it cannot build in that cache)
        pass
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(_child_path())
    try:
        _build_log = tempfile.TemporaryFile()
        _build = subprocess.Popen([sys.executable, "-c", _CHILD, key], stdin=subprocess.DEVNULL, stdout=_build_log,
                                  stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
                                  pass_fds=() if _starter_fd is None else (_starter_fd,))
    finally:
        starter, _starter_fd = _starter_fd, None
        if starter is not None:
            os.close(starter)  # this process's copy, not unlocked: the child's holds the lock now
    threading.Thread(target=_build.wait, name="opbuilder-glue-build", daemon=True).start()
    _state, _next_poll = "building", time.monotonic() + _POLL_SECONDS


#: The build process's program: this module's ``_build_main``, without the working folder that ``-c`` puts first on
#: ``sys.path`` (the parent's own entries come in PYTHONPATH, made absolute).
_CHILD = ("import sys; sys.path[:] = [p for p in sys.path if p != '']; "
          "import runpy; runpy.run_module('opbuilder.torchop.cxx_autograd', run_name='__main__')")


def _child_path() -> list[str]:
    """This process's ``sys.path`` for the build process: each entry absolute (``''``, the working folder, as it is
    now), and the folder this opbuilder was imported from first where an earlier entry holds another one, last
    where no entry is that folder."""
    entries: list[str] = []
    for entry in sys.path:
        if not isinstance(entry, str):
            continue
        try:
            absolute = os.path.abspath(entry)
        except OSError:  # '' where the working folder was removed
            continue
        if os.pathsep not in absolute and absolute not in entries:
            entries.append(absolute)
    import opbuilder

    home = os.path.dirname(os.path.dirname(os.path.abspath(opbuilder.__file__)))
    if os.pathsep in home:
        return entries
    for entry in entries:
        if entry == home:
            return entries
        if os.path.exists(os.path.join(entry, "opbuilder", "__init__.py")):  # would shadow this one
            return [home, *entries]
    # Not on the path (an install's import hook, or '' since the working folder changed): after the others, where
    # it still comes before any import hook.
    return [*entries, home]


def _build_failure() -> str | None:
    """Why the finished background build failed (None: it succeeded); closes its log."""
    global _build_log
    code = _build.returncode
    log, _build_log = _build_log, None
    text = ""
    if log is not None:
        with log:
            log.seek(0)
            text = log.read().decode(errors="replace")
    if code == 0:
        return None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the process building its C++ glue was killed ({name})"
    marked = [line[len(_ERROR_PREFIX):] for line in text.splitlines() if line.startswith(_ERROR_PREFIX)]
    lines = [line for line in text.splitlines() if line.strip()]
    return f"building its C++ glue failed: {marked[-1] if marked else lines[-1] if lines else f'exit status {code}'}"


def _after_fork_in_child() -> None:
    # A fork (a worker process) does not own the parent's build process, nor its waiting thread, nor a lock another
    # thread held: a new lock, and a process that finds the glue in the cache or builds it when it needs it.
    # Nothing here takes a lock another thread may have held at the fork (no warnings filter, no I/O but a close).
    global _lock, _state, _build, _build_log, _starter_fd
    _lock = threading.RLock()
    if _starter_fd is not None:  # another thread was starting a build: its starter lock is that build's to hold,
        starter, _starter_fd = _starter_fd, None  # not this process's for its whole life (a DataLoader worker's)
        os.close(starter)  # closed, not unlocked: unlocking would free it for the parent's build too
    if _build is not None:  # the parent's, whatever the state says (``disabled``, a fork inside _start_build)
        _foreign.append(_build)
        if _build_log is not None:
            _build_log.close()  # this process's copy of it
        _build, _build_log = None, None
        if _state == "building":
            _state = "new"


#: Build processes a fork inherited from its parent: never its own to wait for, kept until exit.
_foreign: list[subprocess.Popen] = []


def _at_exit() -> None:
    # A background build still running at exit finishes on its own (its result is for the next process), and a
    # parent's is not this process's to wait for: no "still running" ResourceWarning for them at exit.
    running = [_build] if _build is not None and _build.poll() is None else []
    for proc in running + _foreign:
        warnings.filterwarnings("ignore", message=f"subprocess {proc.pid} is still running", category=ResourceWarning)
    if _build_log is not None:
        _build_log.close()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)


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
    try:
        with _registering():
            names = getattr(torch.ops, _namespace).bind_registered(op, namespace)
    except Exception as exc:  # noqa: BLE001 (the Python formulas are there: never fail a call)
        warnings.warn(f"opbuilder: {op}'s registered op takes its Python autograd formula: binding its C++ kernel "
                      f"failed: {str(exc).splitlines()[0]}", FallbackWarning, stacklevel=5)
        return frozenset()
    return frozenset(f"{namespace}::{name}" for name in names)


def _bind(op: str, namespace: str, key: tuple[str, str]) -> None:
    """Bind the glue to one loaded op's namespace; a failure leaves that op on the Python path, with a warning."""
    try:
        with _registering():
            getattr(torch.ops, _namespace).bind(op, namespace)
        _bound[key] = True
    except Exception as exc:  # noqa: BLE001 (as in load)
        _bound[key] = False
        warnings.warn(f"opbuilder: {op}'s gradients take the Python path: binding its C++ gradient failed: "
                      f"{str(exc).splitlines()[0]}", FallbackWarning, stacklevel=5)


@contextlib.contextmanager
def _registering() -> Iterator[None]:
    """Around the glue's registration calls (``bind``, ``bind_registered``: torch.ops calls that register, not
    compute): no dispatch mode sees them, and ``torch.jit.trace`` does not record them (its tracer cannot take
    their list of names, and would fail the registration, leaving the op on the Python path for good)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with untraced(), _disable_current_modes():
        yield


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
        # A fork made inside no longer has the build it was waiting for: it looks again.
        _state = "new" if before == "building" and _build is None else before
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
    """``new``, ``building`` (a child of this process builds the glue), ``waiting`` (another process does),
    ``ready`` or ``off``: where this process's C++ gradient path stands."""
    return _state


def _one_line(exc: BaseException) -> str:
    """An exception as one line for the warning: its first line, the compiler's first error line and the full log's
    path where a build error carries them."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    parts = [lines[0]]
    error = next((line for line in lines[1:] if "error" in line.lower() and not line.startswith("full log:")), None)
    if error is None and len(lines) > 1 and not lines[1].startswith("full log:"):
        error = lines[1]
    if error is not None:
        parts.append(error)
    parts += [f"({line})" for line in lines[1:] if line.startswith("full log:")]
    return f"{type(exc).__name__}: {' '.join(parts)}"


def _build_main(argv: list[str]) -> int:
    """The background build (``_start_build``): build the glue whose key is ``argv[0]`` into the cache."""
    try:
        builder = _builder()
        if argv and argv[0] != builder.key:
            import opbuilder

            raise RuntimeError(f"the build process imports opbuilder from {os.path.dirname(opbuilder.__file__)}, "
                               f"whose glue (key {builder.key[:12]}) is not the one asked for (key {argv[0][:12]})")
        builder.load()
    except Exception as exc:  # noqa: BLE001
        print(_ERROR_PREFIX + _one_line(exc), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_build_main(sys.argv[1:]))
