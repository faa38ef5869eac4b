"""``opbuilder check`` and ``opbuilder tune``: every implementation of an op on its definition's workloads
and edge shapes, against a float64 evaluation of the reference; then the passing ones timed with the
benchmark's timer. Statuses as FlashInfer-Bench's: PASSED, INCORRECT_NUMERICAL, INCORRECT_SHAPE,
INCORRECT_DTYPE, COMPILE_ERROR (it cannot be built or loaded here), RUNTIME_ERROR (a call raised).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from opbuilder.dispatch import definitions, implementations, routes, trace
from opbuilder.dispatch.implementations import Implementation

STATUSES = ("PASSED", "INCORRECT_NUMERICAL", "INCORRECT_SHAPE", "INCORRECT_DTYPE", "COMPILE_ERROR", "RUNTIME_ERROR")


@dataclass
class Row:
    implementation: str
    workload: str
    shape: list[int]
    dtype: str
    device: str
    device_name: str
    bucket: list
    status: str
    max_abs: float | None = None
    max_rel: float | None = None
    message: str = ""
    us: float | None = None


def _tensors(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """|got - want| (0 where both are NaN, or equal infinities), its max, and the max relative error."""
    g, w = got.double(), want.double()
    same = (g == w) | (g.isnan() & w.isnan())
    err = torch.where(same, torch.zeros_like(g), (g - w).abs().nan_to_num(nan=float("inf")))
    if err.numel() == 0:
        return err, 0.0, 0.0
    rel = torch.where(err == 0, err, err / w.abs().clamp_min(1e-30))
    return err, err.max().item(), rel.max().item()


def compare(definition: definitions.Definition, workload: definitions.Workload, out: Any, want64: Any,
            want_dtypes: tuple) -> tuple[str, float | None, float | None, str]:
    """(status, max abs error, max rel error, message) of ``out`` against the float64 reference's output."""
    got, want = _tensors(out), _tensors(want64)
    if len(got) != len(want) or not all(isinstance(t, torch.Tensor) for t in got):
        return "INCORRECT_SHAPE", None, None, f"{len(got)} outputs, expected {len(want)} tensors"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return "INCORRECT_SHAPE", None, None, f"output {i}: shape {list(g.shape)}, expected {list(w.shape)}"
    for i, (g, d) in enumerate(zip(got, want_dtypes)):
        if g.dtype != d:
            return "INCORRECT_DTYPE", None, None, f"output {i}: {g.dtype}, expected {d}"
    rtol, atol = definition.tolerance(workload.shape, workload.dtype)
    worst_abs = worst_rel = 0.0
    ok = True
    for g, w in zip(got, want):
        err, abs_max, rel_max = _errors(g.cpu(), w.cpu())
        worst_abs, worst_rel = max(worst_abs, abs_max), max(worst_rel, rel_max)
        ok = ok and bool((err <= atol + rtol * w.cpu().double().abs()).all())
    if not ok:
        return "INCORRECT_NUMERICAL", worst_abs, worst_rel, f"beyond rtol={rtol:.1e}, atol={atol:.1e}"
    return "PASSED", worst_abs, worst_rel, ""


def _call(impl: Implementation, inputs: list) -> Any:
    with torch.no_grad():
        return impl.fn(*inputs)


def check(op: str, device: str | torch.device = "cpu", names: list[str] | None = None) -> list[Row]:
    """One row per implementation and workload (the definition's for this device, then the edge shapes)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{op}: --device cuda, but this torch sees no GPU ({torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: device must be cpu or cuda, got {device.type!r}")
    definition = definitions.get(op)
    impls = [i for i in implementations.of(op) if names is None or i.name in names]
    rows = []
    where = trace.device_name(device.type)
    cases = []
    for w in definition.workloads_for(device):
        inputs = definition.inputs_for(w, device)
        as64 = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
        with torch.no_grad():
            want64 = definition.reference(*as64)
            want_dtypes = tuple(t.dtype for t in _tensors(definition.reference(*inputs)))
        cases.append((w, inputs, want64, want_dtypes))
    for impl in impls:
        try:
            impl.load()
            load_error = None
        except Exception as exc:  # cannot be built or loaded here
            load_error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        for w, inputs, want64, want_dtypes in cases:
            row = Row(impl.name, w.name, list(w.shape), str(w.dtype).removeprefix("torch."), device.type, where,
                      list(trace.bucket(trace.first_tensor(tuple(inputs)))), "COMPILE_ERROR")
            if load_error is not None:
                row.message = load_error
            else:
                try:
                    out = _call(impl, inputs)
                except Exception as exc:
                    row.status, row.message = "RUNTIME_ERROR", f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                else:
                    row.status, row.max_abs, row.max_rel, row.message = compare(definition, w, out, want64, want_dtypes)
            rows.append(row)
    return rows


def keys(op: str) -> dict[str, str]:
    return {i.name: i.key for i in implementations.of(op)}


def save(op: str, rows: list[Row], kind: str) -> Any:
    return trace.write(op, keys(op), [asdict(r) for r in rows], kind)


def tune(op: str, device: str | torch.device = "cpu", budget_ms: float = 200.0) -> list[Row]:
    """``check``, then the median time of each implementation that passed, on each workload."""
    from opbuilder.dispatch.timing import CpuTimer, CudaTimer

    device = torch.device(device)
    rows = check(op, device)
    timer = CpuTimer(budget_ms=budget_ms, warmup_ms=budget_ms / 5) if device.type == "cpu" else \
        CudaTimer(device, budget_ms=budget_ms, warmup_ms=budget_ms / 5)
    definition = definitions.get(op)
    impls = {i.name: i for i in implementations.of(op)}
    inputs_of = {w.name + str(w.dtype): (w, definition.inputs_for(w, device)) for w in definition.workloads_for(device)}
    for row in rows:
        if row.status != "PASSED":
            continue
        w, inputs = inputs_of[row.workload + "torch." + row.dtype]
        impl = impls[row.implementation]
        # A built-in op's own path is timed as dispatch runs it: its public function, without the router.
        fn = implementations.public_function(op) if impl.in_body else impl.fn
        with torch.no_grad(), routes.bypass(op):
            row.us = timer.measure(lambda i: fn(*inputs)).summary()["us"]
    return rows


def last_statuses(op: str) -> dict[str, str]:
    """Implementation -> its worst status in the newer of the last check and tune of this op (any device);
    empty when there is none for these implementations."""
    k = trace.key(keys(op))
    found = [(trace.path(op, k, kind).stat().st_mtime, kind) for kind in ("tune", "check")
             if trace.path(op, k, kind).is_file()]
    if not found:
        return {}
    data = trace.read(op, k, max(found)[1]) or {}
    out: dict[str, str] = {}
    for r in data.get("rows", []):
        worst = out.get(r["implementation"], "PASSED")
        out[r["implementation"]] = max(worst, r["status"], key=STATUSES.index)
    return out
