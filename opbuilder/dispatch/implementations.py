"""Implementations of an op's definition, registered in code, in the order dispatch prefers them when it
has no trace: a compiled op from an ``OpBuilder`` (two builders = two versions, loaded side by side), a
Triton kernel, ``torch.compile`` of the reference, and the reference itself.

Each implementation takes the op's own arguments (as its definition's reference does), has a key that
changes when its code does (the trace of timings is keyed by them), and a ``load()`` that raises when it
cannot run here (no compiler, a build error, no GPU for a Triton kernel).

Registering a user's op with two versions::

    from opbuilder.dispatch import implementations as impls
    impls.register("add_scale", impls.compiled("v1", AddScaleV1Builder()))
    impls.register("add_scale", impls.compiled("v2", AddScaleV2Builder()))
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opbuilder.dispatch.routes import COMPILED, LISTED, bypass
from opbuilder.jit import registry
from opbuilder.jit.builder import OpBuilder


@dataclass
class Implementation:
    """``fn(*args, **kwargs)`` computes the op. ``kind``: compiled, triton, torch.compile, reference or
    python. ``fallback``: whether it may stand in when the one before it cannot load (torch.compile's
    failures show only at its first call, seconds later, so it does not). ``in_body``: the built-in
    function's own compiled path, which its router leaves to the function's body (dispatch.py)."""

    name: str
    kind: str
    fn: Callable[..., Any]
    key_of: Callable[[], str]
    load: Callable[[], None]
    fallback: bool = True
    in_body: bool = False

    @property
    def key(self) -> str:
        return self.key_of()


def source_key(fn: Callable[..., Any]) -> str:
    """A key that changes when a Python function's source does (its name where there is no source)."""
    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):
        text = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _nothing() -> None:
    pass


class _CompiledOp:
    """Calls ``torch.ops.<the builder's namespace>.<op_name>``, loading (building) on first use."""

    def __init__(self, builder: OpBuilder, op_name: str) -> None:
        self.builder, self.op_name, self.op = builder, op_name, None
        self.error: Exception | None = None

    def load(self) -> None:
        """Raises what the build or load raised; a failure is not retried in this process (a check, then
        the first call, would otherwise compile the same broken sources twice)."""
        if self.error is not None:
            raise self.error
        if self.op is None:
            try:
                self.op = getattr(self.builder.load(), self.op_name)
            except Exception as exc:
                self.error = exc
                raise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.op is None:
            self.load()
        return self.op(*args, **kwargs)


def compiled(name: str, builder: OpBuilder, op_name: str | None = None) -> Implementation:
    """A compiled op: ``torch.ops.<builder's namespace>.<op_name>`` (default: the builder's NAME). Two
    builders of one op (e.g. a v1 and a v2 kernel) are two implementations, loaded side by side."""
    op = _CompiledOp(builder, op_name or builder.name)
    return Implementation(name, "compiled", op, lambda: builder.key, op.load)


def python(name: str, fn: Callable[..., Any], kind: str = "python") -> Implementation:
    """A Python function (eager PyTorch, or anything else that needs no build)."""
    return Implementation(name, kind, fn, lambda: source_key(fn), _nothing)


def reference(fn: Callable[..., Any]) -> Implementation:
    return python("reference", fn, kind="reference")


def triton(name: str, fn: Callable[..., Any]) -> Implementation:
    """A Triton kernel's Python launcher. It can only run where triton is installed and a GPU is visible."""

    def load() -> None:
        if importlib.util.find_spec("triton") is None:
            raise ImportError("triton is not installed")
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("Triton kernels need a GPU, and none is visible")

    return Implementation(name, "triton", fn, lambda: source_key(fn), load)


def torch_compiled(fn: Callable[..., Any], name: str = "torch.compile") -> Implementation:
    """``torch.compile`` of ``fn`` (the reference), compiled at its first call."""
    state: dict[str, Callable[..., Any]] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        import torch

        if torch.compiler.is_compiling():  # inside a compiled caller, which compiles the reference itself
            return fn(*args, **kwargs)
        if "fn" not in state:
            state["fn"] = torch.compile(fn, dynamic=False)
        return state["fn"](*args, **kwargs)

    def key() -> str:
        import torch

        return f"{source_key(fn)}-torch{torch.__version__}"

    return Implementation(name, "torch.compile", call, key, _nothing, fallback=False)


# ---- the registry ------------------------------------------------------------------------------------

_IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {}


def register(op: str, implementation: Implementation) -> Implementation:
    """Add (or replace, by name) an implementation of ``op``; the first registered is the default."""
    if not _builtin_added(op):
        _add_builtin(op)
    _IMPLEMENTATIONS.setdefault(op, {})[implementation.name] = implementation
    return implementation


def of(op: str) -> list[Implementation]:
    """The implementations of ``op`` in the order of preference without a trace (the default first)."""
    if not _builtin_added(op):
        _add_builtin(op)
    return list(_IMPLEMENTATIONS.get(op, {}).values())


def public_function(op: str) -> Callable[..., Any]:
    """A built-in op's public function (``opbuilder.ops.<op>.<op>``, named in its record)."""
    return registry.record(op).function


def _builtin_added(op: str) -> bool:
    return op not in registry.BUILDERS or op in LISTED


def _add_builtin(op: str) -> None:
    """A built-in op's implementations: our compiled op (the default), torch.compile of the reference,
    the reference. (No Triton kernel is shipped; register one with ``triton(...)``.)"""
    from opbuilder.dispatch import definitions
    from opbuilder.torchop import lazy

    LISTED.add(op)
    ref = definitions.get(op).reference
    public = public_function(op)

    def ours(*args: Any, **kwargs: Any) -> Any:
        with bypass(op):
            return public(*args, **kwargs)

    builtin = {
        COMPILED: Implementation(COMPILED, "compiled", ours, lambda: registry.get_builder(op).key,
                                   lambda: lazy.loaded(op) and None, in_body=True),
        "torch.compile": torch_compiled(ref),
        "reference": reference(ref),
    }
    _IMPLEMENTATIONS[op] = builtin
