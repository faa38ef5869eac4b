"""What the ops' gradients do not have, refused clearly on either path: a double backward (the norms'; the
Python gradient path's counterpart of ``once_differentiable`` in kernels/autograd/autograd.h), nested
torch.func gradients through them, and forward-mode AD.

Where a backward is itself recorded (``create_graph=True``), its results come out with a node that raises a
clear error when, and only when, a second-order gradient reaches it; the node's edges are those of the
incoming gradients and the saved tensors, so that a gradient asked of the op's inputs reaches it. A
first-order gradient taken that way works; a second-order one is refused instead of silently missing a term
(the backward ops have no autograd formula: recorded as they are, they would give zeros)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad


def double_backward_error(op: str) -> str:
    """The error a second-order gradient through ``op`` raises (the same words as the C++ path's)."""
    return (f"{op}: double backward (a gradient of this op's gradient) is not supported by this op; take the "
            "gradient once, or use the unfused PyTorch ops for higher-order gradients")


_TRANSFORMS_ACTIVE = torch._C._are_functorch_transforms_active


def refuse_forward_ad(op: str, *tensors: torch.Tensor | None) -> None:
    """Raise NotImplementedError where an input carries a forward-mode tangent (``torch.autograd.forward_ad``):
    the ops have no forward formula. The C++ path's kernels refuse it themselves; the Python path's formulas
    (``torch.library.register_autograd``) would let the call through and drop the tangent, a wrong answer.
    Only read where a dual level is open (the eager path's ``direct`` check is false there), not under Dynamo."""
    if torch.compiler.is_compiling() or forward_ad._current_level < 0:
        return
    if any(t is not None and _tangent(t) is not None for t in tensors):
        raise NotImplementedError(
            f"Trying to use forward AD with opbuilder's {op}, which does not support it (no forward-mode formula)")


def _tangent(t: torch.Tensor) -> torch.Tensor | None:
    """t's forward-AD tangent; None where functorch's vmap wraps t (``jvp`` of ``vmap``: unpack_dual has no batching
    rule, an error that names no op): the registered op below the transform then refuses the tangent itself.
    Any other error of unpack_dual is raised (it was taken for "no tangent")."""
    if torch._C._functorch.is_batchedtensor(t):
        return None
    return forward_ad.unpack_dual(t).tangent


def refuse_nested_grad(op: str) -> None:
    """Raise ``double_backward_error(op)`` under two or more torch.func gradient transforms (grad of grad,
    jacrev of jacrev), before the op is recorded: its backward's kernels run below every level, so the node of
    ``once_differentiable`` reaches the innermost level only, and an outer one would take the gradient for a
    constant (zeros). A single level (``grad``, ``vjp``, ``jacrev``, ``vmap`` of ``grad``) goes on. Nothing is
    read while Dynamo traces (``is_compiling`` is a constant there) or without a transform."""
    if torch.compiler.is_compiling() or not _TRANSFORMS_ACTIVE():
        return
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    if sum(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters()) > 1:
        raise RuntimeError(double_backward_error(op))


class _Refuse(torch.autograd.Function):
    """``(op, n, *anchors, *results) -> results``, whose backward raises ``double_backward_error(op)``."""

    @staticmethod
    def forward(op: str, n: int, *tensors: Any) -> tuple[Any, ...]:
        return tuple(None if r is None else r.detach() for r in tensors[n:])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.op = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(double_backward_error(ctx.op))


def once_differentiable(
    op: str,
    backward: Callable[..., tuple[Any, ...]],
    passthrough: Callable[..., bool] | None = None,
) -> Callable[..., tuple[Any, ...]]:
    """``(ctx, *grads)`` for ``register_autograd`` from ``backward(ctx, saved, *grads)`` (``saved``: the
    ctx's saved tensors, read once: a non-reentrant checkpoint allows one unpack), run without recording,
    its results made to refuse a second-order gradient where the backward is recorded (see the module
    docstring). ``passthrough(ctx, *grads)``: True where the backward only hands gradients on (an identity,
    whose own history then stays), so it runs as it is."""

    def wrapped(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        if not torch.is_grad_enabled() or (passthrough is not None and passthrough(ctx, *grads)):
            return backward(ctx, saved, *grads)
        with torch.no_grad():
            results = backward(ctx, saved, *grads)
        anchors = [t for t in (*grads, *saved) if isinstance(t, torch.Tensor)]
        tensors = [r if isinstance(r, torch.Tensor) else None for r in results]
        return _Refuse.apply(op, len(anchors), *anchors, *tensors)

    return wrapped
