"""Running one case (an op at one shape, dtype and pass): ours, eager, torch.compile and any extra eager
formulation, on the same random inputs, each timed the same way; one row of numbers per implementation."""

from __future__ import annotations

import gc
import importlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from opbuilder.tools.bench.liger import adapter as liger_adapter
from opbuilder.tools.bench.specs import Fn, Inputs, OpSpec, Shape, dtype_name, format_shape
from opbuilder.dispatch.timing import Step, Timer, Timing

FORWARD, BACKWARD = "fwd", "fwd+bwd"

#: ||ours - eager|| / ||eager|| above which a row is flagged: a sanity check of what was timed, not a test.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 5e-3, torch.bfloat16: 2e-2}
#: Input gradients may sum over many rows; they get this much more room.
GRAD_TOLERANCE_FACTOR = 2.5
#: Inputs are rotated among enough sets that each set has left the cache before it comes back.
ROTATE_CACHE_MULTIPLE = 4
MAX_SETS = 256
#: A memory-bound case's yardstick at its own size: torch's copy of as many bytes as the op's model counts
#: (half read, half written). Small cases do not reach the big copy's bandwidth, and neither does this copy;
#: it is a reference, not a bound (a kernel with less launch overhead can beat it at a few MB).
SAME_BYTES_COPY = "copy, same bytes"
#: Liger-Kernel's row, where it is installed and has the op (opbuilder/tools/bench/liger.py).
LIGER = "liger"


@dataclass(frozen=True)
class Case:
    spec: OpSpec
    shape: Shape
    dtype: torch.dtype
    mode: str  # FORWARD or BACKWARD

    def label(self) -> str:
        return f"{self.spec.name} {format_shape(self.shape)} {dtype_name(self.dtype)} {self.mode}"


def load_ours(spec: OpSpec) -> tuple[Fn | None, str | None, bool]:
    """(our callable, None, False), or (None, why, is_error). A missing module means the op is not written
    yet: unavailable, not an error. Importing builds nothing; the first call builds."""
    try:
        module = importlib.import_module(spec.module)
    except ModuleNotFoundError as e:
        if e.name and (spec.module == e.name or spec.module.startswith(e.name + ".")):
            return None, f"unavailable: no module {spec.module}", False
        return None, f"import of {spec.module} failed: {type(e).__name__}: {e}", True
    except Exception as e:  # a broken op module must not stop the others
        return None, f"import of {spec.module} failed: {type(e).__name__}: {_first_line(e)}", True
    fn = getattr(module, spec.function, None)
    if fn is None:
        return None, f"unavailable: {spec.module} has no {spec.function}()", False
    return spec.call_ours(fn), None, False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)  # type: ignore[arg-type]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    denom = torch.linalg.vector_norm(want).item()
    return torch.linalg.vector_norm(got - want).item() / (denom if denom > 0 else 1.0)


class CaseRunner:
    def __init__(self, timer: Timer, copy_GBps: float, seed: int = 0, liger: object | None = None) -> None:
        """``liger``: Liger-Kernel's functional module (``opbuilder.tools.bench.liger.load``), or None for no Liger rows."""
        self.timer = timer
        self.device = timer.device
        self.copy_GBps = copy_GBps
        self.seed = seed
        self.liger = liger

    # ---- inputs ----------------------------------------------------------------------------------

    def _make_sets(self, case: Case) -> tuple[list[Inputs], list[tuple[torch.Tensor, ...]] | None]:
        """Input sets (and output gradients for the backward pass), enough to defeat the cache."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed)
        backward = case.mode == BACKWARD
        sets = [case.spec.make_inputs(case.shape, case.dtype, self.device, gen)]
        with torch.no_grad():
            outs = [(o.shape, o.dtype, o.nbytes) for o in _as_tuple(case.spec.eager(*sets[0]))]
        footprint = sum(t.nbytes for t in sets[0]) + sum(nbytes for _, _, nbytes in outs)
        if backward:
            footprint *= 2  # the gradients of each
        wanted = math.ceil(ROTATE_CACHE_MULTIPLE * self.timer.cache_bytes() / footprint)
        count = max(1, min(wanted, MAX_SETS, self.timer.spare_bytes() // footprint))
        sets += [case.spec.make_inputs(case.shape, case.dtype, self.device, gen) for _ in range(count - 1)]
        if not backward:
            return sets, None
        for t in (t for inputs in sets for t in inputs):
            t.requires_grad_(True)
        grads = [
            tuple(torch.randn(shape, device=self.device, generator=gen).to(dtype) for shape, dtype, _ in outs)
            for _ in sets
        ]
        return sets, grads

    # ---- one case ----------------------------------------------------------------------------------

    def run(self, case: Case, ours: Fn) -> list[dict]:
        """One row per implementation; an implementation that fails gets a row with its error."""
        spec, backward = case.spec, case.mode == BACKWARD
        torch._dynamo.reset()  # a fresh compile per case: no recompile limits, no dynamic shapes
        impls: dict[str, Fn] = {"ours": ours, "eager": spec.eager}
        impls["compile"] = torch.compile(spec.eager, dynamic=False)
        peer = liger_adapter(spec.name, self.liger)
        if peer is not None:
            impls[LIGER] = peer
        if not backward:
            impls.update(spec.extras(case.shape))

        sets, out_grads = self._make_sets(case)
        elem = sets[0][0].element_size()
        cost = spec.cost(case.shape, elem, backward)
        if not backward and cost.bytes and not cost.flops:
            impls[SAME_BYTES_COPY] = self._same_bytes_copy(cost.bytes, sets)

        rows: dict[str, dict] = {}
        steps: dict[str, tuple[Step, Callable[[int], None] | None]] = {}
        for impl, fn in impls.items():
            row = rows[impl] = {
                "op": spec.name, "shape": list(case.shape), "dtype": dtype_name(case.dtype), "pass": case.mode,
                "impl": impl, "device": self.device.type, "sets": len(sets), "bytes": cost.bytes, "flops": cost.flops,
            }
            step, reset = self._step(fn, sets, out_grads)
            try:
                row["first_call_s"] = self._first_call(step, reset)  # builds ours, compiles torch.compile's
                steps[impl] = (step, reset)
            except Exception as e:  # one failing implementation must not stop the run
                row["error"] = f"{type(e).__name__}: {_first_line(e)}"

        for impl in ("ours", LIGER):  # what is not PyTorch's own is checked against eager before it is timed
            if impl in steps:
                rows[impl].update(self._check(case, impls[impl], sets[0], out_grads[0] if out_grads else None))

        parts: dict[str, list[Timing]] = {impl: [] for impl in steps}
        for _ in range(self.timer.rounds):
            for impl, (step, reset) in list(steps.items()):
                try:
                    parts[impl].append(self.timer.measure(step, reset))
                except Exception as e:
                    rows[impl]["error"] = f"{type(e).__name__}: {_first_line(e)}"
                    del steps[impl]
        for impl in steps:
            rows[impl].update(Timing.pooled(parts[impl]).summary())
        for t in (t for s in sets for t in s):
            t.grad = None
        del sets, out_grads
        self._free()
        result = list(rows.values())
        _add_rates(result, self.copy_GBps)
        return result

    def _check(self, case: Case, ours: Fn, inputs: Inputs, out_grads: tuple[torch.Tensor, ...] | None) -> dict:
        """Ours against eager on the first input set: outputs, and input gradients for the backward pass."""
        try:
            got, want = self._outputs(ours, inputs, out_grads), self._outputs(case.spec.eager, inputs, out_grads)
        except Exception as e:
            return {"check": "error", "check_note": f"{type(e).__name__}: {_first_line(e)}"}
        if len(got) != len(want):
            return {"check": "fail", "check_note": f"ours gave {len(got)} tensors, eager {len(want)}"}
        errs = [_rel_err(g, w) for g, w in zip(got, want)]
        n_out = len(got) - (len(inputs) if out_grads is not None else 0)
        tol = TOLERANCE.get(case.dtype, 1e-2)
        limits = [tol] * n_out + [tol * GRAD_TOLERANCE_FACTOR] * (len(errs) - n_out)
        ok = all(e <= lim for e, lim in zip(errs, limits))
        return {"check": "ok" if ok else "fail", "rel_err": max(errs), "rel_errs": errs, "tolerance": tol}

    @staticmethod
    def _outputs(fn: Fn, inputs: Inputs, out_grads: tuple[torch.Tensor, ...] | None) -> list[torch.Tensor]:
        if out_grads is None:
            with torch.no_grad():
                return list(_as_tuple(fn(*inputs)))
        for t in inputs:
            t.grad = None
        outs = _as_tuple(fn(*inputs))
        torch.autograd.backward(outs, out_grads)
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        for t in inputs:
            t.grad = None
        return [o.detach() for o in outs] + grads

    def _same_bytes_copy(self, nbytes: int, sets: list[Inputs]) -> Fn:
        """A copy of nbytes / 2 bytes, from a source of its own for each input set (rotated like them), into
        one destination: as the op's output, which the allocator hands back call after call, it stays in the
        cache when it fits, so this row (unlike the big copy in the header) is the yardstick at this size."""
        dst = torch.empty(nbytes // 2, dtype=torch.uint8, device=self.device)
        srcs = {id(inputs[0]): torch.empty_like(dst).random_() for inputs in sets}
        return lambda *inputs: dst.copy_(srcs[id(inputs[0])])

    @staticmethod
    def _step(fn: Fn, sets: list[Inputs], out_grads: list[tuple[torch.Tensor, ...]] | None) -> tuple[Step, Callable[[int], None] | None]:
        """``step(i)``: one call (or forward+backward step) on input set ``i``; ``reset(i)`` clears that set's
        input gradients, untimed, before each backward step."""
        n = len(sets)
        if out_grads is None:
            return (lambda i: fn(*sets[i % n])), None
        grads = out_grads

        def step(i: int) -> object:
            torch.autograd.backward(_as_tuple(fn(*sets[i % n])), grads[i % n])
            return None

        def reset(i: int) -> None:
            for t in sets[i % n]:
                t.grad = None

        return step, reset

    def _first_call(self, step: Step, reset: Callable[[int], None] | None) -> float:
        self.timer.sync()
        t0 = time.perf_counter()
        if reset:
            reset(0)
        step(0)
        self.timer.sync()
        return time.perf_counter() - t0

    def _free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _add_rates(rows: list[dict], copy_GBps: float) -> None:
    """GB/s or TFLOP/s under the cost model, the fraction of the copy bandwidth, and each row's speedups:
    ``vs_<impl> = time of impl / time of this row`` (above 1: this row is faster)."""
    times = {r["impl"]: r["us"] for r in rows if r.get("us")}
    for r in rows:
        us = r.get("us")
        r["GBps"] = r["bytes"] / us / 1e3 if us and r["bytes"] else None
        r["frac_copy"] = r["GBps"] / copy_GBps if r["GBps"] else None
        r["TFLOPs"] = r["flops"] / us / 1e6 if us and r["flops"] else None
        r["vs"] = {impl: t / us for impl, t in times.items()} if us else {}
        r["vs_eager"] = r["vs"].get("eager")
        r["vs_compile"] = r["vs"].get("compile")
        r["vs_liger"] = r["vs"].get(LIGER)
