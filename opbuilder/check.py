"""``opbuilder check`` and ``opbuilder tune``: every implementation of an op on its definition's workloads
and edge shapes, against a float64 evaluation of the reference; then the passing ones timed with the
benchmark's timer. Statuses as FlashInfer-Bench's: PASSED, INCORRECT_NUMERICAL, INCORRECT_SHAPE,
INCORRECT_DTYPE, COMPILE_ERROR (it cannot be built or loaded here), RUNTIME_ERROR (a call raised); and
MUTATES_INPUT (it wrote into an input: each implementation gets its own copies of the inputs, compared
with the originals after the call, so one that writes into them neither passes nor fools the next).

Where the reference gives an infinity or NaN, only the same value passes: the tolerance there would be
infinite (or NaN), so it is not used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from opbuilder import definitions, dispatch, implementations, trace
from opbuilder.implementations import Implementation

STATUSES = ("PASSED", "INCORRECT_NUMERICAL", "INCORRECT_SHAPE", "INCORRECT_DTYPE", "COMPILE_ERROR", "RUNTIME_ERROR",
            "MUTATES_INPUT")


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


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """|got - want| (0 where both are NaN, or equal infinities), where they are the same value (NaN
    included), the max error, and the max relative error."""
    g, w = got.double(), want.double()
    same = (g == w) | (g.isnan() & w.isnan())
    err = torch.where(same, torch.zeros_like(g), (g - w).abs().nan_to_num(nan=float("inf")))
    if err.numel() == 0:
        return err, same, 0.0, 0.0
    rel = torch.where(err == 0, err, err / w.abs().clamp_min(1e-30))
    return err, same, err.max().item(), rel.max().item()


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
        err, same, abs_max, rel_max = _errors(g.cpu(), w.cpu())
        worst_abs, worst_rel = max(worst_abs, abs_max), max(worst_rel, rel_max)
        w64 = w.cpu().double()
        # where the reference is inf or NaN its tolerance is too: only the same value passes there
        ok = ok and bool((same | (w64.isfinite() & (err <= atol + rtol * w64.abs()))).all())
    if not ok:
        return "INCORRECT_NUMERICAL", worst_abs, worst_rel, f"beyond rtol={rtol:.1e}, atol={atol:.1e}"
    return "PASSED", worst_abs, worst_rel, ""


def _call(impl: Implementation, inputs: list) -> Any:
    with torch.no_grad():
        return impl.fn(*inputs)


def _copy(t: Any) -> Any:
    """A tensor's copy with the same sizes and strides (contiguous where they overlap); other values as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    try:
        return out.copy_(t)
    except RuntimeError:  # an expanded input: its elements share memory, a copy cannot
        return t.clone()


def _written(before: list, after: list, names: list[str]) -> str | None:
    """Which input an implementation wrote into (``after`` its copies of ``before``), or None."""
    for i, (b, a) in enumerate(zip(before, after)):
        if not isinstance(b, torch.Tensor):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            changed = True
        else:
            same = a == b
            if b.is_floating_point() or b.is_complex():
                same |= a.isnan() & b.isnan()
            changed = not bool(same.all())
        if changed:
            name = f" ({names[i]})" if i < len(names) else ""
            return f"it wrote into input {i}{name}; an implementation must leave its inputs as they were"
    return None


def _run(definition: definitions.Definition, impl: Implementation, w: definitions.Workload, inputs: list,
         want64: Any, want_dtypes: tuple, row: Row) -> None:
    """Call ``impl`` on its own copies of ``inputs``; set the row's status, errors and message."""
    mine = [_copy(t) for t in inputs]
    try:
        out = _call(impl, mine)
    except Exception as exc:
        row.status, row.message = "RUNTIME_ERROR", f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        return
    row.status, row.max_abs, row.max_rel, row.message = compare(definition, w, out, want64, want_dtypes)
    written = _written(inputs, mine, list(definition.inputs))
    if written is not None:
        row.status, row.message = "MUTATES_INPUT", written


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
            want64 = definition.reference(*[_copy(t) for t in as64])
            want_dtypes = tuple(t.dtype for t in _tensors(definition.reference(*[_copy(t) for t in inputs])))
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
                _run(definition, impl, w, inputs, want64, want_dtypes, row)
            rows.append(row)
    return rows


def keys(op: str) -> dict[str, str]:
    return {i.name: i.key for i in implementations.of(op)}


def save(op: str, rows: list[Row], kind: str) -> Any:
    return trace.write(op, keys(op), [asdict(r) for r in rows], kind)


def tune(op: str, device: str | torch.device = "cpu", budget_ms: float = 200.0) -> list[Row]:
    """``check``, then the median time of each implementation that passed, on each workload."""
    from opbuilder.bench.timing import CpuTimer, CudaTimer

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
        with torch.no_grad(), dispatch.bypass(op):
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
