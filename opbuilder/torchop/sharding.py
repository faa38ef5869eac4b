"""DTensor sharding rules for ops, one line an op, registered only when DTensor is in use.

DTensor (the engine under FSDP2's ``fully_shard`` and ``torch.distributed.tensor.parallel``) runs an op
on each rank's local pieces only if it knows which input layouts the op accepts and what layout its
outputs then have: a *sharding rule*. An op without one fails on DTensor inputs ("does not have a
sharding strategy registered"). A rule lists, for one mesh dimension, acceptable pairs of (output
placements, input placements); torch combines them over the mesh's dimensions and, where an input's
layout fits no pair, first redistributes it to the cheapest one that does. Rules go to torch through its
public extension point, ``torch.distributed.tensor.experimental.register_sharding``.

Helpers, for an op's ``_register(ns)`` (``op`` is an ``OpOverload``, e.g. ``torch.ops.<ns>.relu.default``):

- ``elementwise(op)``: each output element depends on the same element of each input (inputs broadcast
  from the right): any ``Shard(d)`` of the output, the inputs split alike, or all replicated.
- ``rowwise(op, params=..., reduced=..., linear=...)``: the op reads each row ``[..., hidden]`` whole
  (a norm, a softmax over the last dim). Rows may be split on any dim but the last; ``params`` (e.g.
  ``weight``) are replicated; ``reduced`` outputs are sums over rows (a weight's gradient), ``Partial``
  when rows are split; ``linear`` names the inputs the op is linear in (a backward's incoming gradients),
  which may then come ``Partial`` and give ``Partial`` outputs.
- ``matmul(op, linear=...)``: ``lhs [(B,) M, K] @ rhs [(B,) K, N] (+ bias)``, as torch's ``mm``/``bmm``:
  split on B, M or N, the bias like the output; K split only when the op is linear (no epilogue such as
  a ReLU), giving a ``Partial`` output.
- ``custom(op, rule)``: ``rule`` is a function as ``register_sharding`` takes: it gets the op's arguments
  (a tensor as a spec with ``.ndim``, ``.shape``, ``.placements``; None where an optional tensor is
  None) and returns a list of ``(output placements, input placements)``, None for a non-tensor input.

Importing ``torch.distributed.tensor`` costs about half a second, which users who never shard should not
pay. So nothing here imports it: a rule is registered at once when that module is already imported, and
otherwise kept until it is (a one-shot import hook registers the kept rules right after its import).
``is_dtensor(x)`` tells a DTensor without importing it either.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

Rule = Callable[..., Sequence[tuple[list[Any], list[Any]]]]

_DTENSOR = "torch.distributed.tensor"
_PENDING: list[tuple[torch._ops.OpOverload, Rule]] = []
_LOCK = threading.Lock()

__all__ = ["custom", "elementwise", "is_dtensor", "matmul", "rowwise"]


# ---- registration -------------------------------------------------------------------------------------


def custom(op: torch._ops.OpOverload, rule: Rule) -> None:
    """Register ``rule`` (``register_sharding``'s function form, see the module docstring) for ``op``, now
    if DTensor is imported, else as soon as it is."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"sharding: op must be an OpOverload (e.g. torch.ops.ns.name.default), got {type(op).__name__}")
    with _LOCK:
        if _DTENSOR not in sys.modules:
            _PENDING.append((op, rule))
            _watch_import()
            return
    _register_now(op, rule)


def _register_now(op: torch._ops.OpOverload, rule: Rule) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    register_sharding(op)(rule)
    # DTensor caches an op's result layouts and global shapes by its inputs' specs and by the arguments
    # from ``static_argnum`` on. register_sharding counts only int arguments, so a bool or float that
    # changes an output's shape (fused_relu_layernorm_backward's affine_grads) would get another call's
    # cached shape: every argument from the first non-tensor one on is made part of the key.
    tensors = set(_tensor_arg_names(op))
    first = next((i for i, a in enumerate(op._schema.arguments) if a.name not in tensors), 100)
    # (A private table of torch 2.13's propagator: where a later torch lacks it, register_sharding's own
    # choice stands.)
    infos = getattr(DTensor._op_dispatcher.sharding_propagator, "op_to_schema_info", None)
    if isinstance(infos, dict):
        static = [a.name for a in op._schema.arguments if a.kwarg_only and a.name not in tensors]
        infos[op] = RuntimeSchemaInfo(first, static or None, needs_pytree=True)


def _flush() -> None:
    """Register the rules kept while DTensor was not imported."""
    with _LOCK:
        pending = _PENDING[:]
        _PENDING.clear()
    for op, rule in pending:
        _register_now(op, rule)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch.distributed.tensor`` is about to be imported, it asks the other
    finders for the module and wraps its loader so that the kept rules are registered after the import."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _DTENSOR:
            return None
        _unwatch()
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _FlushingLoader(spec.loader)
        return spec


class _FlushingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader
        try:
            _flush()
        except Exception as exc:  # a failed registration must not fail the user's import
            warnings.warn(f"opbuilder: could not register DTensor sharding rules: {exc!r}", RuntimeWarning,
                          stacklevel=2)


_HOOK = _AfterImport()


def _watch_import() -> None:
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def _unwatch() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a DTensor, without importing DTensor (where it is not imported, nothing is one)."""
    if type(x) is torch.Tensor:  # the common case, in a few tens of nanoseconds
        return False
    module = sys.modules.get(_DTENSOR)
    return module is not None and isinstance(x, module.DTensor)


# ---- rules --------------------------------------------------------------------------------------------


def _named_args(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The arguments as DTensor passes them (positional, then keyword), with their schema names."""
    names = [a.name for a in op._schema.arguments]
    return list(zip(names, args)) + list(kwargs.items())


def _tensor_arg_names(op: torch._ops.OpOverload) -> list[str]:
    """The names of the op's ``Tensor`` and ``Tensor?`` arguments, in schema order."""
    names = []
    for a in op._schema.arguments:
        t = a.type.getElementType() if isinstance(a.type, torch.OptionalType) else a.type
        if isinstance(t, torch.TensorType):
            names.append(a.name)
    return names


def _check_names(helper: str, op: torch._ops.OpOverload, what: str, names: Sequence[str]) -> None:
    if isinstance(names, str):
        raise TypeError(f"sharding.{helper}: {what} must be a list of argument names, got the string {names!r}")
    known = _tensor_arg_names(op)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"sharding.{helper}: {what} must name tensor arguments of {op._schema.name} "
                         f"({', '.join(known)}), got {unknown}")


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "placements") and hasattr(value, "ndim")


def _like_output(value: Any, out_ndim: int, placement: Any) -> Any:
    """The placement of an input broadcast (from the right) to an output placed as ``placement``."""
    from torch.distributed.tensor import Replicate, Shard

    if not isinstance(placement, Shard):
        return placement
    dim = placement.dim - (out_ndim - value.ndim)
    if dim < 0 or value.shape[dim] == 1:
        return Replicate()
    return Shard(dim)


def elementwise(op: torch._ops.OpOverload, linear: Sequence[str] = ()) -> None:
    """An op whose outputs (of the broadcast inputs' shape) are computed element by element.

    linear: names of the inputs the op is jointly linear in (e.g. a gradient), which may then be Partial
    while the others are replicated. Default: none (Partial inputs are reduced first).
    """
    _check_names("elementwise", op, "linear", linear)
    n_out = len(op._schema.returns)

    def rule(*args: Any, **kwargs: Any) -> list[tuple[list[Any], list[Any]]]:
        from torch.distributed.tensor import Partial, Replicate, Shard

        named = _named_args(op, args, kwargs)
        ndim = max((v.ndim for _, v in named if _is_tensor(v)), default=0)
        choices = [Replicate()] + [Shard(d) for d in range(ndim)]
        out = []
        for p in choices:
            inputs = [_like_output(v, ndim, p) if _is_tensor(v) else None for _, v in named]
            out.append(([p] * n_out, inputs))
        if linear:
            inputs = [(Partial() if n in linear else Replicate()) if _is_tensor(v) else None for n, v in named]
            out.append(([Partial()] * n_out, inputs))
        return out

    custom(op, rule)


def rowwise(
    op: torch._ops.OpOverload,
    params: Sequence[str] = (),
    reduced: Sequence[int] = (),
    linear: Sequence[str] = (),
) -> None:
    """An op that reads each row (the last dim of its widest input) whole.

    params: names of the inputs that are per-feature parameters (``[hidden]``), always replicated.
    reduced: indices of the outputs that are sums over the rows (a parameter's gradient): Partial when the
        rows are split, replicated otherwise.
    linear: names of the inputs the op is jointly linear in (a backward's incoming gradients): they may
        come Partial, with the other inputs replicated, and every output is then Partial.
    Every other tensor (input or output) is a row tensor ``[..., hidden]`` or per-row ``[...]`` (a norm's
    statistics): split on one dim d < ndim - 1 alike, or replicated. As aten's norms and softmax, the rule
    follows a split the inputs already have and replicates the rows where they come split along them: it
    never moves a split to another dim (an all-to-all there, and another back where the next layer wants
    the old split, as a tensor-parallel linear does). A Partial input may go to any split (a reduce-scatter).
    """
    _check_names("rowwise", op, "params", params)
    _check_names("rowwise", op, "linear", linear)
    n_out = len(op._schema.returns)
    bad = [i for i in reduced if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_out]
    if bad:
        raise ValueError(f"sharding.rowwise: reduced must hold output indices in [0, {n_out - 1}] for "
                         f"{op._schema.name}, got {bad}")

    def rule(*args: Any, **kwargs: Any) -> list[tuple[list[Any], list[Any]]]:
        from torch.distributed.tensor import Partial, Replicate, Shard

        named = _named_args(op, args, kwargs)
        rows = [v for n, v in named if _is_tensor(v) and n not in params]
        ndim = max((v.ndim for v in rows), default=0)
        placements = [p for v in rows for p in v.placements]
        if any(isinstance(p, Partial) for p in placements):
            dims = range(ndim - 1)
        else:
            dims = sorted({p.dim for p in placements if isinstance(p, Shard) and 0 <= p.dim < ndim - 1})
        out = []
        for p in [Replicate()] + [Shard(d) for d in dims]:
            split = isinstance(p, Shard)
            outputs = [Partial() if split and i in reduced else p for i in range(n_out)]
            inputs = [(Replicate() if n in params else p) if _is_tensor(v) else None for n, v in named]
            out.append((outputs, inputs))
        if linear:
            inputs = [(Partial() if n in linear else Replicate()) if _is_tensor(v) else None for n, v in named]
            out.append(([Partial()] * n_out, inputs))
        return out

    custom(op, rule)


def matmul(op: torch._ops.OpOverload, linear: bool = False) -> None:
    """An op ``out = f(lhs @ rhs (+ bias))`` with one output; its first two tensor arguments are ``lhs``
    ``[M, K]`` or ``[B, M, K]`` and ``rhs`` ``[K, N]`` or ``[B, K, N]`` (a batch of 1 or none broadcasts),
    an optional third the bias, broadcastable to the output.

    linear: whether ``out`` is linear in ``lhs @ rhs`` and the bias (no epilogue such as a ReLU): then K
    may be split too, and the output is Partial (the bias too, so that it is added once).
    """

    if len(_tensor_arg_names(op)) < 2 or len(op._schema.returns) != 1:
        raise ValueError(f"sharding.matmul: {op._schema.name} must take lhs and rhs tensors and return one "
                         f"tensor, got the schema {op._schema}")

    def rule(*args: Any, **kwargs: Any) -> list[tuple[list[Any], list[Any]]]:
        from torch.distributed.tensor import Partial, Replicate, Shard

        named = _named_args(op, args, kwargs)
        value = dict(named)
        slot = [n for n in _tensor_arg_names(op) if n in value][:3]
        lhs, rhs = value[slot[0]], value[slot[1]]
        bias = value[slot[2]] if len(slot) > 2 else None
        out_ndim = max(lhs.ndim, rhs.ndim)

        def batch(t: Any) -> Any:
            return Shard(0) if t.ndim == 3 and t.shape[0] != 1 else Replicate()

        # (output, lhs, rhs); the bias follows the output.
        cases = [
            (Replicate(), Replicate(), Replicate()),
            (Shard(out_ndim - 2), Shard(lhs.ndim - 2), Replicate()),
            (Shard(out_ndim - 1), Replicate(), Shard(rhs.ndim - 1)),
        ]
        if out_ndim == 3:
            cases.append((Shard(0), batch(lhs), batch(rhs)))
        if linear:
            cases.append((Partial(), Shard(lhs.ndim - 1), Shard(rhs.ndim - 2)))
        out = []
        for o, pl, pr in cases:
            if isinstance(o, Shard) and pl == pr == Replicate():
                continue  # both batches broadcast: nothing to split the output's batch with
            placed = {slot[0]: pl, slot[1]: pr}
            if _is_tensor(bias):
                placed[slot[2]] = o if isinstance(o, Partial) else _like_output(bias, out_ndim, o)
            out.append(([o], [placed.get(n) if _is_tensor(v) else None for n, v in named]))
        return out

    custom(op, rule)
