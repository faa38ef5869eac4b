"""Dispatch: each call of an op goes to the fastest implementation that passed for its device, dtype and
shape bucket (per the trace ``opbuilder tune`` left in the cache); with no trace, to the default (the
first registered: our compiled op for the built-in ones). An implementation that cannot be built or
loaded here (no compiler, a build error, an incompatible GPU) gives way to the next one, and finally to
the reference, with one ``FallbackWarning`` naming the op and the reason; ``OPB_FALLBACK=0`` raises the
error instead.

Built-in ops: their public functions (``opbuilder.ops``) start with ``route = ROUTES.get(op)``. Before the
first call ``ROUTES`` holds the op's ``Router``; the first call resolves it (``resolve``: loads the
default, reads the trace). When there is no trace and our op loads, the op leaves ``ROUTES`` and every
later call is today's direct call plus that one dict lookup. Otherwise the router stays: it returns
None where our compiled op is the choice (the function's body goes on to call it) and the chosen
implementation's result elsewhere.

User ops: ``apply(name)`` on the reference function (FlashInfer-Bench's decorator), after the op's
definition and implementations are registered (``opbuilder.dispatch.definitions``, ``opbuilder.dispatch.implementations``).

Under ``torch.compile``: ``resolve`` is marked as having a constant result, so Dynamo runs it once while
tracing (the build, the file reads) and traces the router's table lookup and the chosen function.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

from opbuilder import env
from opbuilder.dispatch.routes import COMPILED, LISTED, ROUTES
from opbuilder.errors import EnvError, FallbackWarning
from opbuilder.jit.registry import BUILDERS


#: The name of ``apply``'s decorated function among the choices.
FINAL = "apply's function"


def _continue(*args: Any, **kwargs: Any) -> None:
    """A built-in op's own compiled path: the public function's body calls it."""
    return None


class Router:
    """Sends a call to the implementation chosen for its (device type, dtype, shape bucket); a call on a device
    no trace is timed on (meta, mps, ...) to the default, as with no trace."""

    def __init__(self, op: str, final: Callable[..., Any] | None = None) -> None:
        self.op = op
        self.final = final  # the function ``apply`` decorated: the last resort
        self.table: dict[Any, Callable[..., Any]] | None = None  # None until the first call resolves it
        self.default: Callable[..., Any] = _continue
        self.picks: dict[Any, str] = {}  # the same choices by implementation name (report, tests)
        self.default_name = ""
        # Resolved to the direct path while Dynamo traced in this thread (its ident; 0: not): leave ROUTES at
        # that thread's next call, when the trace's guards are built.
        self.leave_in_thread = 0
        self.params: tuple[str, ...] = ()  # the function's parameters, in order (for calls by keyword)
        if final is not None:
            functools.update_wrapper(self, final)
            with contextlib.suppress(TypeError, ValueError):
                self.params = tuple(inspect.signature(final).parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # resolve() first, every call (at once when resolved): under torch.compile no attribute of the
        # router may be read before it, or Dynamo would guard on the table being None.
        resolve(self.op)
        table = self.table
        if table:
            x = args[0] if args and hasattr(args[0], "is_cuda") else _first_tensor(args, kwargs, self.params)
            if x is None:  # no tensor among the arguments: no bucket
                return self.default(*args, **kwargs)
            # _key(x), inline: the cheapest reads of a tensor (x.device builds an object; is_cuda does not)
            cuda = x.is_cuda
            if not cuda and not x.is_cpu:  # meta, mps, ...: no trace's choice holds there
                return self.default(*args, **kwargs)
            n = x.numel()
            if type(n) is int:
                key = (cuda, x.dtype, n.bit_length(), x.ndim == 0 or x.shape[-1] % 8 == 0)
            else:
                key = _untraced_key(x)
            # the call's bucket; else (a bucket no workload had) its device, dtype and kind of width; else its device
            fn = table.get(key) or table.get((key[0], key[1], key[3])) or table.get((key[0],)) or self.default
            return fn(*args, **kwargs)
        return self.default(*args, **kwargs)

    def pick(self, *args: Any, **kwargs: Any) -> str:
        """The name of the implementation a call with these arguments goes to (resolving first)."""
        resolve(self.op)
        x = _first_tensor(args, kwargs, self.params)
        if x is None or not (x.is_cuda or x.is_cpu):
            return self.default_name
        key, picks = _key(x), self.picks
        return picks.get(key) or picks.get((key[0], key[1], key[3])) or picks.get((key[0],)) or self.default_name


def _first_tensor(args: tuple, kwargs: dict[str, Any] | None = None, params: tuple[str, ...] = ()) -> Any:
    """The call's first tensor: among the positional arguments, then the keyword ones in the order of the
    function's parameters (then any others); None when there is none."""
    from opbuilder.dispatch.trace import first_tensor

    x = first_tensor(args)
    if x is None and kwargs:
        x = first_tensor(tuple(kwargs[p] for p in params if p in kwargs) + tuple(kwargs.values()))
    return x


def _key(x: Any) -> tuple:
    """A call's (on a GPU, dtype, size class, last dim a multiple of 8): trace.bucket's facts, flat."""
    n = x.numel()
    if type(n) is not int:
        return _untraced_key(x)
    return x.is_cuda, x.dtype, n.bit_length(), x.ndim == 0 or x.shape[-1] % 8 == 0


def _untraced_key(x: Any) -> tuple:
    """``_key`` under ``torch.jit.trace``, where sizes are traced tensors: read with the tracer paused (the choice
    is Python's, made at the trace and kept in its graph, as any Python branch is)."""
    from opbuilder.torchop.tracer import untraced

    with untraced():
        return _key(x)


def _flat(where: tuple) -> tuple:
    """A trace's (device type, dtype, bucket) as ``_key`` makes it."""
    device, dtype, (size, aligned) = where
    return device == "cuda", dtype, size, aligned


_LOCK = threading.RLock()


def _after_fork_in_child() -> None:
    """A new lock in a forked child: a thread of the parent that was resolving at the fork (loading, maybe
    building, for minutes) holds the old one for ever there, and the child's first call or reset would wait on
    it. A half-made choice is never seen: ``_resolve`` sets the table last, so the child resolves again."""
    global _LOCK
    _LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)

ROUTES.update({name: Router(name) for name in BUILDERS})
_ROUTERS: dict[str, Router] = dict(ROUTES)


def router(op: str) -> Router:
    if op not in _ROUTERS:
        from opbuilder.errors import UnknownOpError

        raise UnknownOpError(f"no dispatched op named {op!r}; known: {', '.join(_ROUTERS)} (apply() adds one)")
    return _ROUTERS[op]


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def resolve(op: str) -> bool:
    """Choose the op's implementations (once, at its first call); True when it stays routed.

    Loads the default (building it if needed) and, where the trace names others, those. An implementation
    that cannot load gives way to the next; one FallbackWarning says which and why. Raises the load error
    when ``OPB_FALLBACK=0``, or when nothing at all can run.
    """
    r = _ROUTERS[op]
    if r.table is not None and not r.leave_in_thread:  # every call after the first: no lock
        return True
    with _LOCK:  # two threads' first calls: one resolves, one warning
        return _resolve(op)


def _resolve(op: str) -> bool:
    from opbuilder.dispatch import trace

    r = _ROUTERS[op]
    if r.table is not None:
        if r.leave_in_thread == threading.get_ident() and not _tracing():
            ROUTES.pop(op, None)
            r.leave_in_thread = 0
        return op in ROUTES or op not in BUILDERS
    failed: dict[str, BaseException] = {}
    if op in BUILDERS and op not in LISTED and not trace.any_for(op):
        # The usual first call: no trace, and no implementation registered beside the op's own three, so
        # the choice is our compiled op, the first of them: loaded here without making the others (the
        # whole table below, when it cannot load).
        from opbuilder.torchop import lazy

        try:
            lazy.loaded(op)
        except EnvError:  # a variable to fix, not a reason to fall back
            raise
        except Exception as exc:
            if not env.fallback():
                raise
            failed[COMPILED] = exc
        else:
            r.picks, r.default_name, r.default, r.table = {}, COMPILED, _continue, {}
            _leave(op, r)
            return False

    from opbuilder.dispatch import implementations

    impls = {i.name: i for i in implementations.of(op)}

    def usable(name: str) -> bool:
        impl = impls[name]
        if name in failed:
            return False
        try:
            impl.load()
            return True
        except EnvError:  # a variable to fix, not a reason to fall back
            raise
        except Exception as exc:  # a build error, no compiler, no GPU, a bad artifact: try the next
            if not env.fallback():
                raise
            failed[name] = exc
            return False

    def first_usable(skip: set[str] = frozenset()) -> tuple[str, Callable[..., Any]] | None:
        for name, impl in impls.items():
            if impl.fallback and name not in skip and usable(name):
                return name, _continue if impl.in_body else impl.fn
        return (FINAL, r.final) if r.final is not None else None

    first = first_usable()
    if first is None:
        if failed:
            raise next(iter(failed.values()))
        raise RuntimeError(f"{op}: no implementation is registered")
    default_name, default = first
    # the tune's times; the statuses of the newer of the tune and the check (a later check overrides a tune).
    # No traces of the op: no implementation's key is worked out.
    tuned, verdicts = trace.records(op, trace.key({n: i.key for n, i in impls.items()})) \
        if impls and trace.any_for(op) else (None, [])
    excluded = trace.excluded(verdicts)
    picks: dict[Any, str] = {}
    for where, name in (trace.choices(tuned, excluded) if tuned else {}).items():
        if name in impls and usable(name):
            picks[where] = name
    for where, names in excluded.items():
        if where not in picks and default_name in names and (other := first_usable(names)) is not None:
            picks[where] = other[0]
    # Buckets no workload had: not to a default that failed their kind of width, or everything, on the device.
    elsewhere: dict[Any, str] = {}
    for where, names in trace.excluded_elsewhere(verdicts).items():
        if default_name in names and (other := first_usable(names)) is not None:
            elsewhere[(where[0] == "cuda",) + tuple(where[1:])] = other[0]
    if elsewhere:  # the buckets a workload had keep their own choice (the default where it passed them)
        for where in trace.buckets(verdicts):
            picks.setdefault(where, default_name)

    if failed:
        why = "; ".join(f"{name}: {_reason(exc)}" for name, exc in failed.items())
        warnings.warn(f"opbuilder: {op}: cannot use {why}; calls go to {default_name}", FallbackWarning,
                      stacklevel=_callers_level())
    picks = {_flat(where): name for where, name in picks.items()} | elsewhere
    r.picks, r.default_name, r.default = picks, default_name, default
    r.table = {key: (_continue if impls[name].in_body else impls[name].fn) if name in impls else r.final
               for key, name in picks.items()}
    if op in BUILDERS and not picks and default is _continue:
        _leave(op, r)
        return False
    return True


def _leave(op: str, r: Router) -> None:
    """The direct path: today's call plus one dict lookup. While Dynamo traces, the op stays in ROUTES
    (its router sends the call to the body all the same): the guards made after the trace read it. It leaves
    at the tracing thread's next call, after those guards are built; a call of another thread meanwhile goes
    through the router (its first eager call had removed the route under the guards being built)."""
    if _tracing():
        r.leave_in_thread = threading.get_ident()
    else:
        ROUTES.pop(op, None)


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside opbuilder (its functions in ``opbuilder.ops`` too) and
    outside torch's compiler: the user's line that called the op, for a warning to point at."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "opbuilder" or module.startswith(("opbuilder.", "torch._dynamo", "torch._inductor"))):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def _tracing() -> bool:
    """Whether Dynamo is tracing now (``resolve`` runs for real while it does)."""
    import torch._guards

    return torch._guards.TracingContext.try_get() is not None


resolve._dynamo_marked_constant = True  # type: ignore[attr-defined]


def reset(op: str | None = None) -> None:
    """Forget the choices (of one op, or all), so that the next call resolves again: after a new trace,
    or new implementations, in this process."""
    from opbuilder.dispatch import implementations

    with _LOCK:  # not in the middle of another thread's resolve, whose table would overwrite the reset
        for name in [op] if op else list(_ROUTERS):
            if name not in _ROUTERS and implementations.of(name):
                continue  # registered, not yet applied: no choice made yet, nothing to forget
            r = router(name)
            # The table only: a call of another thread that has passed its resolve() and reads the table
            # after this finds None and goes to the previous default, which can still run the call (a
            # default reset to _continue returned None from a user op's call).
            r.table, r.leave_in_thread = None, 0
            if name in BUILDERS:
                ROUTES[name] = r


def apply(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@apply("name")`` on the op's reference function: calls go to the implementation chosen for them,
    and to the decorated function when none can run. On a built-in op's name, the decorated function is
    replaced by the built-in one (``opbuilder.ops``), which dispatches itself and falls back to the same
    reference."""

    from opbuilder import paths

    paths.check_op_name(op)  # its traces' folder, under the cache

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if op in BUILDERS:
            from opbuilder.dispatch.implementations import public_function

            public = public_function(op)

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                return public(*args, **kwargs)

            return call
        r = Router(op, final=fn)
        _ROUTERS[op] = r
        return r

    return decorate
