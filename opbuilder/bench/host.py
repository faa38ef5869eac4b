"""Host time per call: what the CPU spends in one call of our op against the PyTorch call, or the unfused
sequence of PyTorch calls, it replaces, on inputs so small that the kernels cost almost nothing.

A model with small tensors (decoding, small batches) pays this for every call, whatever the device.
Measured as the calling thread's CPU time (``time.thread_time``), so other processes on a busy machine
do not count; each figure is the least over several rounds, ours and PyTorch's taking turns.

Beside them, two of our own: the registered op through ``torch.ops`` (with the Python autograd kernel
``register_autograd`` puts in front of it), and the floor whatever our Python function does: without a
gradient the C++ op called alone (its nograd overload's C entry: torch's boxed call and the kernel's host
work), with one the same op inside an ``autograd.Function`` that saves nothing (``bare_function``).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class Registered:
    """The registered op ``opbuilder.ops.<module>.<getter>()`` (an OpOverload), called on the spec's inputs
    with ``extra`` appended (eps); ``first``: the first output only. Resolved when measured (it loads the op)."""

    module: str
    getter: str
    extra: tuple = ()
    first: bool = False

    def overload(self) -> torch._ops.OpOverload:
        return getattr(importlib.import_module(f"opbuilder.ops.{self.module}"), self.getter)()

    def bind(self, call: Callable[..., object]) -> Fn:
        """``call`` as a function of the spec's inputs."""
        extra = self.extra
        if self.first:
            return lambda *inputs: call(*inputs, *extra)[0]
        return lambda *inputs: call(*inputs, *extra)

    def __call__(self) -> Fn:
        """Through ``torch.ops``: the registered op with its Python autograd kernel."""
        return self.bind(self.overload())


def _op(module: str, getter: str, *extra: object, first: bool = False) -> Registered:
    return Registered(module, getter, extra, first)


def _nograd(overload: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The op's overload without autograd (``<op>.nograd``, opbuilder/eager.py), where it has one."""
    packet = overload._overloadpacket
    return getattr(packet, "nograd") if "nograd" in packet.overloads() else None


def alone(op: Registered) -> Fn:
    """The C++ op called alone, no Python of ours around it: its nograd overload's C entry (what a plain
    eager call of ours runs), or the registered op below the Autograd keys where it has none."""
    overload = op.overload()
    nograd = _nograd(overload)
    if nograd is not None:
        if op.first and len(nograd._schema.returns) == 1:  # it returns only what ours does (LayerNorm's y)
            return replace(op, first=False).bind(nograd._op)
        return op.bind(nograd._op)
    entry = overload._op

    def below_autograd(*args: object) -> object:
        with torch._C._AutoDispatchBelowAutograd():
            return entry(*args)

    return op.bind(below_autograd)


def bare_function(op: Registered) -> Fn:
    """The C++ op inside an ``autograd.Function`` that saves nothing, applied through the C entry of
    ``Function.apply``: what recording a call with a Python autograd formula costs at least. Its forward runs
    what our Function's runs: the nograd overload where it returns the registered op's outputs, else the
    registered op below the Autograd keys."""
    overload = op.overload()
    nograd = _nograd(overload)
    if nograd is not None and len(nograd._schema.returns) == len(overload._schema.returns):
        run = nograd._op
    else:
        entry = overload._op

        def run(*args: object) -> object:
            with torch._C._AutoDispatchBelowAutograd():
                return entry(*args)

    def forward(ctx: object, *args: object) -> object:
        return run(*args)

    def backward(ctx: object, *grads: object) -> object:
        raise RuntimeError("bench.host: a timing stand-in, not for backward")

    cls = type("BareFunction", (torch.autograd.Function,),
               {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    return op.bind(torch._C._FunctionBase.__dict__["apply"].__get__(None, cls))


@dataclass(frozen=True)
class HostCase:
    #: what ours is held against, in words and as a function of the spec's inputs
    torch_name: str
    torch_fn: Fn
    #: the most ours may cost, as a multiple of the torch call (the issue's targets)
    limit: float
    #: our registered op: plain, and the one a gradient takes
    op: Registered
    grad_op: Registered | None = None


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
        measured = (case.grad_op or case.op) if grad else case.op
        registered, floor = measured(), (bare_function(measured) if grad else alone(measured))
        fns = {"ours": lambda: ours(*inputs), "torch": lambda: case.torch_fn(*inputs),
               "torch.ops": lambda: registered(*inputs), "floor": lambda: floor(*inputs)}
        times = time_calls(fns, calls=calls, rounds=rounds, sync=sync)
        ratio = times["ours"] / times["torch"]
        rows.append({
            "op": op, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "device": device.type,
            "requires_grad": grad, "ours_us": times["ours"], "torch": case.torch_name, "torch_us": times["torch"],
            "ratio": ratio, "limit": case.limit, "within": ratio <= case.limit,
            # our op through torch.ops (its Python autograd kernel included); and the floor whatever the Python
            # function does: without a gradient the C++ op called alone (torch's boxed call, the kernel's host
            # work), with one the same inside an autograd.Function that saves nothing
            "torch_ops_us": times["torch.ops"], "floor_us": times["floor"],
        })
    rows.append(_measure_step(op, ours, case, spec, shape, dtype, device, gen, sync, calls, rounds))
    return rows


def _outputs(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _measure_step(op: str, ours: Fn, case: HostCase, spec, shape, dtype, device, gen, sync, calls: int,
                  rounds: int) -> dict:
    """The row of a forward *and* backward with ``requires_grad`` on every input (what a training step pays
    for the call): ours with its C++ gradient path (``opbuilder.cxx_autograd``), ours with the Python path,
    and the torch call(s). The backward is ``torch.autograd.backward`` of every output with a gradient of ones;
    the inputs' ``.grad`` are dropped after each call, as ``grad = None`` does."""
    from opbuilder import cxx_autograd

    cxx_autograd.load(wait=True)
    inputs: Inputs = [t.requires_grad_(True) for t in spec.make_inputs(shape, dtype, device, gen)]
    ones = [torch.ones_like(o) for o in _outputs(case.torch_fn(*inputs))]

    def step(fn: Fn) -> Callable[[], None]:
        def run() -> None:
            torch.autograd.backward(_outputs(fn(*inputs)), ones)
            for t in inputs:
                t.grad = None
        return run

    fns = {"ours": step(ours), "torch": step(case.torch_fn)}
    times = time_calls(fns, calls=calls // 2, rounds=rounds, sync=sync)
    with cxx_autograd.disabled():
        python = time_calls({"ours": step(ours)}, calls=calls // 2, rounds=rounds, sync=sync)["ours"]
    limit = STEP_LIMITS.get(op, 1.0)
    ratio = times["ours"] / times["torch"]
    return {
        "op": op, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "device": device.type,
        "requires_grad": "fwd+bwd", "ours_us": times["ours"], "torch": case.torch_name, "torch_us": times["torch"],
        "ratio": ratio, "limit": limit, "within": ratio <= limit, "python_path_us": python,
        "cxx_autograd": cxx_autograd.state(),
    }


#: A forward and backward's most, as a multiple of the torch call(s) (issue 23): relu and softmax 2x the
#: torch call; a fused op no more than the unfused sequence.
STEP_LIMITS = {"relu": 2.0, "softmax": 2.0}


def table(rows: list[dict]) -> str:
    """The rows as aligned text."""
    head = ["op", "grad", "ours (us)", "torch (us)", "ratio", "target", "", "torch.ops (us)", "floor (us)",
            "python path (us)", "against"]
    body = [head] + [[
        r["op"], {True: "yes", False: "no"}.get(r["requires_grad"], str(r["requires_grad"])), f"{r['ours_us']:.2f}",
        f"{r['torch_us']:.2f}", f"{r['ratio']:.2f}", f"<= {r['limit']:g}", "ok" if r["within"] else "MISSED",
        f"{r['torch_ops_us']:.2f}" if "torch_ops_us" in r else "-", f"{r['floor_us']:.2f}" if "floor_us" in r else "-",
        f"{r['python_path_us']:.2f}" if "python_path_us" in r else "-", r["torch"],
    ] for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(head))]
    right = {2, 3, 4, 7, 8, 9}
    return "\n".join(
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
        for line in body
    )
