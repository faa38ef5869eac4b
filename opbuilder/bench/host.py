"""Host time per call: what the CPU spends in one call of our op against the PyTorch call, or the unfused
sequence of PyTorch calls, it replaces, on inputs so small that the kernels cost almost nothing.

A model with small tensors (decoding, small batches) pays this for every call, whatever the device.
Measured as the calling thread's CPU time (``time.thread_time``), so other processes on a busy machine
do not count; each figure is the least over several rounds, ours and PyTorch's taking turns.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opbuilder.bench.specs import LN_EPS, RMS_EPS, SPECS, Fn, Inputs

#: The issue's measure: 16-element tensors (one row of 16 for the row-wise ops; 4x4 operands for the matmul).
HOST_SHAPES: dict[str, tuple[int, ...]] = {
    "relu": (16,),
    "softmax": (1, 16),
    "fused_relu_layernorm": (1, 16),
    "fused_add_rmsnorm": (1, 16),
    "fused_matmul_add_relu": (4, 4, 4),
}


def _unfused_add_rmsnorm(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = inp + residual
    return F.rms_norm(h, (h.shape[-1],), weight, RMS_EPS), h


def _unfused_relu_layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(torch.relu(x), (x.shape[-1],), weight, bias, LN_EPS)


def _op(module: str, getter: str, *extra: object, first: bool = False) -> Callable[[], Fn]:
    """The registered op ``opbuilder.ops.<module>.<getter>()`` as a function of the spec's inputs (``extra``
    appended: eps); ``first``: keep the first output only. Resolved when measured (it loads the op)."""

    def make() -> Fn:
        op = getattr(importlib.import_module(f"opbuilder.ops.{module}"), getter)()
        if first:
            return lambda *inputs: op(*inputs, *extra)[0]
        return lambda *inputs: op(*inputs, *extra)

    return make


@dataclass(frozen=True)
class HostCase:
    #: what ours is held against, in words and as a function of the spec's inputs
    torch_name: str
    torch_fn: Fn
    #: the most ours may cost, as a multiple of the torch call (the issue's targets)
    limit: float
    #: our op straight through ``torch.ops`` (no Python checks): plain, and the one a gradient takes
    op: Callable[[], Fn]
    grad_op: Callable[[], Fn] | None = None


HOST_CASES: dict[str, HostCase] = {
    "relu": HostCase("torch.relu", torch.relu, 2.5, _op("relu", "relu_op"), _op("relu", "relu_mask_op", first=True)),
    "softmax": HostCase("torch.softmax", lambda x: torch.softmax(x, -1), 2.5, _op("softmax", "forward_op")),
    "fused_relu_layernorm": HostCase("F.layer_norm(torch.relu(x))", _unfused_relu_layernorm, 1.0,
                                     _op("fused_relu_layernorm", "fused_relu_layernorm_op", LN_EPS, first=True)),
    "fused_add_rmsnorm": HostCase("x + r, F.rms_norm", _unfused_add_rmsnorm, 1.0,
                                  _op("fused_add_rmsnorm", "fused_add_rmsnorm_op", RMS_EPS)),
    "fused_matmul_add_relu": HostCase("torch.relu(a @ b + c)", lambda a, b, c: torch.relu(a @ b + c), 1.0,
                                      _op("fused_matmul_add_relu", "fused_matmul_add_relu_op")),
}


def time_calls(fns: dict[str, Callable[[], object]], *, calls: int = 2000, rounds: int = 15,
               sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Host µs per call of each function: the least over ``rounds`` rounds of ``calls`` calls each, the
    functions taking turns so that a slow spell of the machine hits all of them."""
    for fn in fns.values():  # warm-up: builds, first-call caches
        for _ in range(50):
            fn()
    sync()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.thread_time_ns()
            for _ in range(calls):
                fn()
            elapsed = time.thread_time_ns() - t0
            sync()  # outside the timed part: the device catches up before the next function
            best[name] = min(best[name], elapsed / calls / 1e3)
    return best


def measure_op(op: str, ours: Fn, device: torch.device, dtype: torch.dtype = torch.float32, *,
               calls: int = 2000, rounds: int = 15) -> list[dict]:
    """Two rows (without and with ``requires_grad`` on every input): ours and the torch call(s) in host µs
    per forward call, their ratio, and the target it is held to."""
    spec, case = SPECS[op], HOST_CASES[op]
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    shape = HOST_SHAPES[op]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for grad in (False, True):
        inputs: Inputs = [t.requires_grad_(grad) for t in spec.make_inputs(shape, dtype, device, gen)]
        registered = (case.grad_op or case.op)() if grad else case.op()
        fns = {"ours": lambda: ours(*inputs), "torch": lambda: case.torch_fn(*inputs),
               "torch.ops": lambda: registered(*inputs)}
        if not grad:
            def alone() -> object:
                with torch._C._AutoDispatchBelowAutograd():
                    return registered(*inputs)

            fns["c++ alone"] = alone
        times = time_calls(fns, calls=calls, rounds=rounds, sync=sync)
        ratio = times["ours"] / times["torch"]
        rows.append({
            "op": op, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "device": device.type,
            "requires_grad": grad, "ours_us": times["ours"], "torch": case.torch_name, "torch_us": times["torch"],
            "ratio": ratio, "limit": case.limit, "within": ratio <= case.limit,
            # our op through torch.ops (its Python autograd kernel included), and below that kernel: the floor
            # the C++ op and torch's boxed call set, whatever the Python function does
            "torch_ops_us": times["torch.ops"], "cpp_alone_us": times.get("c++ alone"),
        })
    return rows


def table(rows: list[dict]) -> str:
    """The rows as aligned text."""
    head = ["op", "grad", "ours (us)", "torch (us)", "ratio", "target", "", "torch.ops (us)", "c++ alone (us)", "against"]
    body = [head] + [[
        r["op"], "yes" if r["requires_grad"] else "no", f"{r['ours_us']:.2f}", f"{r['torch_us']:.2f}",
        f"{r['ratio']:.2f}", f"<= {r['limit']:g}", "ok" if r["within"] else "MISSED", f"{r['torch_ops_us']:.2f}",
        "-" if r["cpp_alone_us"] is None else f"{r['cpp_alone_us']:.2f}", r["torch"],
    ] for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(head))]
    right = {2, 3, 4, 7, 8}
    return "\n".join(
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
        for line in body
    )
