"""The dispatch part of ``opbuilder report``, and the tables ``opbuilder check`` and ``tune`` print.

Nothing here builds: what dispatch would pick is worked out from the trace and from whether our op can
be built here, without loading anything.
"""

from __future__ import annotations

from typing import Any

import torch

from opbuilder import check, implementations, registry, trace


def _where(device: str, dtype: torch.dtype, bucket: tuple[int, bool]) -> str:
    size, aligned = bucket
    numel = f"{1 << (size - 1)}..{(1 << size) - 1}" if size else "0"
    return f"{device} {str(dtype).removeprefix('torch.')} numel {numel}{'' if aligned else ', width % 8 != 0'}"


def op_dispatch(op: str) -> dict[str, Any]:
    """The op's implementations with their last check status, and what dispatch picks (per bucket)."""
    impls = implementations.of(op)
    statuses = check.last_statuses(op)
    tuned, verdicts = trace.records(op, trace.key(check.keys(op)))
    picks = {_where(*where): name for where, name in (trace.choices(tuned, trace.excluded(verdicts)) if tuned else {}).items()}
    default = impls[0].name if impls else "-"
    if op in registry.BUILDERS and registry.get_builder(op).incompatibility_reasons():
        default = next((i.name for i in impls[1:] if i.fallback), "-")
    return {
        "implementations": [{"name": i.name, "kind": i.kind, "last_check": statuses.get(i.name)} for i in impls],
        "default": default,
        "picks": picks,
    }


def collect() -> dict[str, Any]:
    out = {}
    for op in registry.names():
        try:
            out[op] = op_dispatch(op)
        except Exception as exc:  # one broken op must not hide the others
            out[op] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def render(data: dict[str, Any]) -> str:
    lines = ["", "dispatch (opbuilder check OP / opbuilder tune OP)",
             f"{'op':<22} {'implementations (last check)':<66} picks"]
    for op, d in data.items():
        if "error" in d:
            lines.append(f"{op:<22} {d['error']}")
            continue
        impls = ", ".join(f"{i['name']} ({i['last_check'] or 'unchecked'})" for i in d["implementations"])
        picks = "; ".join(f"{w}: {n}" for w, n in d["picks"].items())
        lines.append(f"{op:<22} {impls:<66} {picks + '; else ' if picks else ''}{d['default']}"
                     + ("" if picks else " (no trace)"))
    return "\n".join(lines)


def render_rows(rows: list[check.Row]) -> str:
    head = f"{'implementation':<16} {'workload':<18} {'dtype':<9} {'status':<20} {'max abs':>9} {'max rel':>9} {'us':>10}"
    lines = [head]
    for r in rows:
        num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(f"{r.implementation:<16} {r.workload:<18} {r.dtype:<9} {r.status:<20} "
                     f"{num(r.max_abs, '9.2e')} {num(r.max_rel, '9.2e')} {num(r.us, '10.1f')}"
                     + (f"  {r.message}" if r.message and r.status != "PASSED" else ""))
    return "\n".join(lines)
