"""Under ``torch.compile``, a small call of a built-in op traces the op's PyTorch definition instead of
calling its kernel.

A compiled graph calls our op as an opaque kernel: Inductor can fuse nothing into it or across it, and each
such call costs the graph more host time than a kernel Inductor generates (an extern call, its outputs
allocated through the stable ABI's shim). Where the tensors are small, the step is host-bound and those costs
outweigh a faster kernel: PyTorch's layers, compiled, ran faster than ours at dim 256. There the public
function returns its op's definition (the record's ``reference``, the same arithmetic as the kernel: float32
statistics, one rounding) as PyTorch ops, which Inductor fuses with the neighbouring ones. Larger calls keep
our kernel. ``OPB_COMPILE_INLINE_BELOW`` sets the size (elements of the op's first input); 0 keeps our kernel
at every size. It is read when Dynamo traces: code already compiled keeps its choice until it is traced again
(``torch._dynamo.reset()``). ``torch.export`` always keeps the op.
"""

from __future__ import annotations

import torch

from opbuilder import env

# Dynamo's own flag: torch.compiler.is_compiling() is True in every thread while any compile runs (torch 2.14),
# so an eager call in another thread would take the definition.
_IS_DYNAMO_COMPILING = torch.compiler.is_dynamo_compiling


def _below() -> int:
    # Run by Dynamo once per trace and taken as a constant (no guard): a change of the variable takes effect
    # when the code is traced again. Export keeps the op: torch's flag is read here, where Dynamo does not
    # see it (the Dynamo of torch 2.11, the GPU machine's, took ``torch.compiler.is_exporting()`` as True under
    # torch.compile; 2.13 and 2.14 do not).
    if getattr(torch.compiler, "_is_exporting_flag", False):
        return 0
    return env.compile_inline_below()


# What torch.compiler.assume_constant_result does, without importing Dynamo when an op is imported.
_below._dynamo_marked_constant = True  # type: ignore[attr-defined]


def inline(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` traced by ``torch.compile`` (not export) takes the op's PyTorch definition."""
    if not _IS_DYNAMO_COMPILING():
        return False
    # Imported here: Dynamo has imported it by now, and importing it costs an eager process sympy.
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    # A size known only at run time (unbacked: x = y[y > 0]) keeps the op rather than fail to compile.
    return guard_or_false(x.numel() < _below())
