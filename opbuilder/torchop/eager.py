"""Calling a loaded op in eager mode with little host work.

Every op with a Python autograd formula (``torch.library.register_autograd``) has a Python kernel at
the dispatcher's Autograd key, so each call through ``torch.ops`` runs Python there -- a pytree walk, a
``redispatch`` and, when a gradient is needed, a generated ``autograd.Function`` -- even when no input
needs a gradient. For a small tensor that is most of the call's time (16 floats on a CPU: 5.2 us
through ``torch.ops`` against 1.1 us for ``torch.relu``). So, in plain eager mode, the op functions
call the C++ op directly:

- no gradient needed: the op's ``nograd`` overload where it has one (``<op>.nograd``: the same kernels
  with no autograd formula, so its Autograd key is torch's C++ fallback, and only the outputs a caller
  sees, e.g. LayerNorm's y without mean and rstd), one C call; else the op's C++ entry below the
  Autograd keys (what the registered kernel does itself after its checks), one guard and one call;
- a gradient needed, for a built-in op: the op's ``grad`` overload, whose Autograd kernel is C++
  (``opbuilder.torchop.cxx_autograd``): one C call, and a backward without Python. Until that glue is there (or
  where it cannot be built, and for a user's op), as below;
- a gradient needed: an ``autograd.Function`` made from the *same* ``setup_context`` and ``backward``
  that were registered (``register_autograd`` here records them), applied through the C entry of
  ``Function.apply`` (the Python ``apply`` binds the signature and checks for functorch first). Its
  forward runs the ``nograd`` overload where that returns what the registered op returns. This
  Function is the floor of a call that needs a gradient (about 2.5 us on the 2-core CPU machine where
  aten records a C++ node in well under 1): the stable ABI has no C++ autograd kernel to register.

A ``nograd`` overload is not differentiable: called by hand on inputs that need a gradient, it gets
torch's fallback for ops without autograd (a warning at backward, no gradient). The functions here
take it only where no gradient is recorded.

Everything else -- ``torch.compile`` (Dynamo traces the registered op), ``torch.jit.trace``, functorch
transforms (vmap, grad), forward-mode AD -- takes the registered op, so opcheck, compile and autograd see one
op. Under autocast, an op with an autocast rule (``register_autocast``) takes the registered op where a gradient
is needed (the rule must cast before autograd sees the inputs); its ``nograd`` overload carries the
same rule.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad

_BELOW_AUTOGRAD = below_autograd = torch._C._AutoDispatchBelowAutograd
_TRANSFORMS_ACTIVE = torch._C._are_functorch_transforms_active
_ANY_REQUIRES_GRAD = torch._C._any_requires_grad
_ANY_AUTOCAST = torch._C._is_any_autocast_enabled
_IS_COMPILING = torch.compiler.is_compiling
_IS_DYNAMO_COMPILING = torch.compiler.is_dynamo_compiling
_IS_TRACING = torch._C._is_tracing  # torch.jit.trace
# The C part of Function.apply: builds the graph node and runs forward(ctx, *args) with grad mode off.
_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]

# "ns::op" or "ns::op.overload" -> (setup_context, backward), as given to register_autograd.
_AUTOGRAD: dict[str, tuple[Callable[..., None], Callable[..., Any]]] = {}
# "ns::op" -> the Python call that records a gradient and returns what the C++ ``grad`` overload returns,
# where that is not the op's own autograd.Function (relu's takes relu_mask's and drops the mask).
_PYTHON_GRAD: dict[str, Callable[..., Any]] = {}


# namespace -> the register_autograd calls not made yet (see register_autograd).
_QUEUED: dict[str, list[tuple[str, Callable[..., Any], Callable[..., None]]]] = {}
_QUEUE_LOCK = threading.Lock()


def register_autograd(qualname: str, backward: Callable[..., Any], *, setup_context: Callable[..., None]) -> None:
    """``torch.library.register_autograd(qualname, backward, setup_context=...)``, made by ``register_queued``
    (about half a millisecond each: a call without a gradient never needs it), and the two functions kept
    for the eager path at once. ``setup_context(ctx, inputs, output)`` gets every input positionally."""
    _QUEUED.setdefault(qualname.partition("::")[0], []).append((qualname, backward, setup_context))
    _AUTOGRAD[qualname.removesuffix(".default")] = (setup_context, backward)


def register_queued(namespace: str, builtin: str | None = None) -> None:
    """Make the namespace's queued ``torch.library.register_autograd`` calls. Done before anything reaches
    the op through the dispatcher's Autograd key: the registered op's first use (``opbuilder.torchop.lazy``:
    a trace, DTensor, a transform, the ``*_op()`` functions) and the first eager call that records a gradient
    (``EagerOp.grad``: its backward may call other ops of the namespace, e.g. a double backward). For a
    built-in op (``builtin``: its name) whose C++ glue is at hand, the ops it covers get C++ Autograd kernels
    instead (``cxx_autograd.registered``), and only the rest their Python formulas."""
    if namespace not in _QUEUED:  # every call but the first: one read
        return
    with _QUEUE_LOCK:  # another thread's first call waits until the registrations are made
        queued = _QUEUED.get(namespace)
        if queued is None:
            return
        covered: frozenset[str] = frozenset()
        if builtin is not None:
            from opbuilder.torchop import cxx_autograd

            covered = cxx_autograd.registered(builtin, namespace)
        for qualname, backward, setup_context in queued:
            if qualname.removesuffix(".default") not in covered:
                _register_python_formula(qualname, backward, setup_context, builtin)
        _QUEUED.pop(namespace, None)


# namespace -> the Library its Python formulas are registered through (kept: dropping it would unregister them)
_FORMULAS: dict[str, torch.library.Library] = {}


def _register_python_formula(qualname: str, backward: Callable[..., Any], setup_context: Callable[..., None],
                             builtin: str | None) -> None:
    """``torch.library.register_autograd(qualname, backward, setup_context=...)``, its Autograd kernel wrapped
    so that it refuses a forward-AD tangent. torch's kernel sends inputs that need no gradient, a dual tensor's
    primal among them, straight below autograd, so the registered op returned no tangent: a wrong answer without
    a word (the C++ glue's kernels refuse such inputs themselves). Outside a dual level the wrapper is one read.
    torch.library builds that kernel with ``torch._library.autograd.make_autograd_impl`` (the same since torch
    2.4); a torch without it gets torch.library's own registration (tests/torchop/test_cxx_autograd.py's
    forward-AD test then fails)."""
    try:
        from torch._library import utils
        from torch._library.autograd import Info, make_autograd_impl
    except ImportError:  # pragma: no cover (every torch this project supports has it)
        torch.library.register_autograd(qualname, backward, setup_context=setup_context)
        return
    from opbuilder.torchop.once import refuse_forward_ad

    op = utils.lookup_op(qualname)
    is_out = getattr(utils, "is_out", None)  # torch 2.13 on; before it, an out= op is refused as mutating (below)
    if (is_out is not None and is_out(op)) or not utils.is_functional_schema(op._schema) \
            or utils.has_kwarg_only_tensors(op._schema):
        # A schema torch.library refuses a formula for (an out= or mutating op: the Function would not know of the
        # mutation; a kwarg-only Tensor: make_autograd_impl passes it beside the Function, so it got no gradient):
        # its own registration raises its own error.
        torch.library.register_autograd(qualname, backward, setup_context=setup_context)
        return

    ns, _, name = qualname.partition("::")
    packet = name.partition(".")[0]
    label = f"{builtin or ns}.{packet}"  # e.g. "softmax.forward"
    autograd_kernel = make_autograd_impl(op, Info(backward, setup_context))

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if forward_ad._current_level >= 0:
            refuse_forward_ad(label, *(a for a in args if isinstance(a, torch.Tensor)))
        return autograd_kernel(keyset, *args, **kwargs)

    lib = _FORMULAS.get(ns)
    if lib is None:
        lib = _FORMULAS[ns] = torch.library.Library(ns, "FRAGMENT")
    lib.impl(name, kernel, "Autograd", with_keyset=True)


def register_python_grad(qualname: str, call: Callable[..., Any]) -> None:
    """``EagerOp.grad``'s Python path for the op ``qualname`` ("ns::op"), where it is not ``EagerOp.apply``."""
    _PYTHON_GRAD[qualname] = call


def direct() -> bool:
    """Whether a call may go to the C++ op directly: not traced by Dynamo or export (``is_compiling``
    is a constant True in Dynamo, so a traced call takes the registered op), nor by ``torch.jit.trace`` (its
    graph then holds the registered op, with its autograd formula, whatever the grad mode at the trace; and
    one op from one line with or without a gradient, as its check of the trace under ``no_grad`` asks), no
    functorch transform, no forward AD."""
    return not (_IS_COMPILING() or _TRANSFORMS_ACTIVE() or forward_ad._current_level >= 0 or _IS_TRACING())


def jit_tracing() -> bool:
    """Whether ``torch.jit.trace`` records this call (never asked of the tracer under Dynamo, which cannot trace
    the question; Dynamo's own flag: ``is_compiling()`` is True in every thread while any compile runs)."""
    return not _IS_DYNAMO_COMPILING() and _IS_TRACING()


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must record a call on these inputs."""
    return torch.is_grad_enabled() and _ANY_REQUIRES_GRAD(*tensors)


#: The overload name of an op's forward without autograd (see the module docstring).
NOGRAD = "nograd"


class EagerOp:
    """One loaded op overload's direct entries.

    ``call(*args)``: the op without autograd (the result needs no gradient). ``nograd(*args)``: the
    op's ``nograd`` overload, a C callable (no guard needed: its Autograd key is torch's fallback, which
    records nothing where no input needs a gradient); None where the op has none. ``apply(*args)``: the
    op recorded by autograd with its registered formula (the C entry of ``Function.apply`` itself where
    the op has no autocast rule); None when it has none. ``grad(*args)``: the call that records a gradient,
    returning what the op's function returns: the C++ ``grad`` overload of a built-in op
    (``opbuilder.torchop.cxx_autograd``) once it is there, until then (and for a user's op) the Python path.
    """

    __slots__ = ("apply", "builtin", "call", "entry", "grad", "name", "nograd", "overload")

    def __init__(self, overload: torch._ops.OpOverload, builtin: str | None = None) -> None:
        self.overload = overload
        # The C++ callable OpOverload.__call__ forwards to. ``with below_autograd(): entry(*args)`` is
        # ``call(*args)`` without its Python frame, for the ops whose every 0.1 us shows (relu, softmax).
        self.entry = entry = overload._op

        def call(*args: Any) -> Any:
            with _BELOW_AUTOGRAD():
                return entry(*args)

        self.call = call
        packet = overload._overloadpacket
        nograd = getattr(packet, NOGRAD) if overload._overloadname == "default" and NOGRAD in packet.overloads() else None
        self.nograd = None if nograd is None else nograd._op
        name = overload._schema.name
        if overload._overloadname != "default":
            name = f"{name}.{overload._overloadname}"
        registered = _AUTOGRAD.get(name)
        # The Function's forward: the nograd overload where it returns all the registered op returns
        # (setup_context may save any output), without the guard's Python object and frame.
        same = nograd is not None and len(nograd._schema.returns) == len(overload._schema.returns)
        self.apply = None if registered is None else _function(name, overload, entry, same and self.nograd,
                                                               *registered)
        self.name, self.builtin = name, builtin
        self.grad = self._first_grad

    def _first_grad(self, *args: Any) -> Any:
        # Until the C++ path is there: asks for it (cheap: a time check while it is being built) and takes
        # the Python path; once it is, ``grad`` is its C callable and this frame is gone.
        from opbuilder.torchop import cxx_autograd

        register_queued(self.name.partition("::")[0], self.builtin)
        if self.builtin is not None and self.overload._overloadname == "default":
            ns, _, op = self.name.partition("::")
            call = cxx_autograd.entry(self.builtin, ns, op)
            if call is not None:
                if _has_autocast_rule(self.name):
                    call = _autocast_aware(self.overload, call)
                self.grad = call
                return call(*args)
        python = _PYTHON_GRAD.get(self.name, self.apply)
        if python is None:
            raise RuntimeError(f"opbuilder: {self.name} has no autograd formula")
        if self.builtin is None or cxx_autograd.state() == "off":
            self.grad = python  # no C++ path to wait for
        return python(*args)


def _autocast_aware(overload: torch._ops.OpOverload, call: Callable[..., Any]) -> Callable[..., Any]:
    def grad(*args: Any) -> Any:
        # As in _function: the op's autocast rule must cast before autograd records.
        if _ANY_AUTOCAST():
            return overload(*args)
        return call(*args)

    return grad


def _function(name: str, overload: torch._ops.OpOverload, entry: Callable[..., Any], nograd: Callable[..., Any] | None,
              setup_context: Callable[..., None], backward: Callable[..., Any]) -> Callable[..., Any]:
    # Function.apply runs forward with grad mode off, so the nograd overload's autograd fallback only
    # passes the call on; the registered op needs the guard (its Python autograd kernel would run).
    if nograd:
        def forward(ctx: Any, *args: Any) -> Any:
            output = nograd(*args)
            setup_context(ctx, args, output)
            return output
    else:
        def forward(ctx: Any, *args: Any) -> Any:
            with _BELOW_AUTOGRAD():
                output = entry(*args)
            setup_context(ctx, args, output)
            return output

    cls = type(f"Eager_{name.replace('::', '_').replace('.', '_')}", (torch.autograd.Function,),
               {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    function_apply = _FUNCTION_APPLY.__get__(None, cls)
    if not _has_autocast_rule(name):
        return function_apply  # autocast passes such an op by: the Function is what the registered op does

    def apply(*args: Any) -> Any:
        # Under autocast an op's autocast rule casts where the op is dispatched: the registered op
        # casts before its autograd kernel sees the inputs, this Function only after. Take the former.
        if _ANY_AUTOCAST():
            return overload(*args)
        return function_apply(*args)

    return apply


_AUTOCAST_KEYS = [key for key in torch._C.DispatchKey.__members__ if key.startswith("Autocast")]


def _has_autocast_rule(name: str) -> bool:
    """Whether the op ("ns::op" or "ns::op.overload") has a kernel at an autocast key (a
    ``register_autocast`` rule), as its registrations stand when its first eager call binds it."""
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in _AUTOCAST_KEYS)


class EagerOps:
    """A loaded ``torch.ops`` namespace's ops as ``EagerOp``s: ``EagerOps(ns).relu`` is the ``default``
    overload of ``ns.relu``, made on first access and kept."""

    def __init__(self, namespace: Any, builtin: str | None = None) -> None:
        self._namespace = namespace
        self._builtin = builtin  # the built-in op's name: its gradients may take the C++ path

    def __getattr__(self, name: str) -> EagerOp:
        if name.startswith("_"):
            raise AttributeError(name)
        op = EagerOp(getattr(self._namespace, name).default, self._builtin)
        setattr(self, name, op)
        return op
