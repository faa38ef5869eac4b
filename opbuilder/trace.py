"""The small JSON records ``opbuilder check`` and ``opbuilder tune`` leave in the cache, and what dispatch
reads from them.

``<cache root>/traces/<op>/<key>.json`` (tune: statuses and times) and ``<key>.check.json`` (check:
statuses). The key hashes torch's and CUDA's versions and every implementation's key, so editing a
kernel, adding an implementation or upgrading torch starts a new trace; rows carry their device's name,
so one file holds the runs of several devices. A shape bucket is what ``bucket()`` makes of the call's
first tensor: its size class (the bit length of its element count) and whether its last dim is a
multiple of 8 (the widths the vectorised paths take).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from opbuilder import env

Bucket = tuple[int, bool]


def bucket(x: torch.Tensor) -> Bucket:
    return x.numel().bit_length(), (x.shape[-1] % 8 == 0) if x.dim() else True


def first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


@functools.lru_cache(maxsize=None)
def device_name(device_type: str) -> str:
    """The GPU's name, or the CPU's model: a trace's times hold for that device only."""
    if device_type == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def key(implementation_keys: dict[str, str]) -> str:
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "implementations": implementation_keys}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def path(op: str, trace_key: str, kind: str = "tune") -> Path:
    suffix = ".json" if kind == "tune" else f".{kind}.json"
    return env.cache_root() / "traces" / op / f"{trace_key}{suffix}"


def read(op: str, trace_key: str, kind: str = "tune") -> dict[str, Any] | None:
    return _read_dated(op, trace_key, kind)[0]


def _read_dated(op: str, trace_key: str, kind: str) -> tuple[dict[str, Any] | None, int]:
    """(the record, or None; its file's modification time in ns, 0 when there is none)."""
    where = path(op, trace_key, kind)
    try:
        with open(where) as fh:
            return json.load(fh), os.fstat(fh.fileno()).st_mtime_ns
    except (OSError, ValueError):
        return None, 0


def records(op: str, trace_key: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the tune record or None, the rows whose statuses count on this machine's devices).

    For each implementation and device, the rows of the newer of the two records that has rows of it: a
    check run after a tune overrides the tune's statuses (an implementation it fails is never sent those
    calls, whatever the tune's times said), and a tune run after a check (a tune checks again) overrides
    the check's. Of two records written at the same time, the failures of both count.
    """
    tune, tune_time = _read_dated(op, trace_key, "tune")
    checked, check_time = _read_dated(op, trace_key, "check")
    if tune_time == check_time:
        return tune, (_here(tune) if tune else []) + (_here(checked) if checked else [])
    newer, older = (tune, checked) if tune_time > check_time else (checked, tune)
    rows = _here(newer) if newer else []
    seen = {(r["implementation"], r["device"]) for r in rows}
    return tune, rows + [r for r in (_here(older) if older else []) if (r["implementation"], r["device"]) not in seen]


def write(op: str, implementation_keys: dict[str, str], rows: list[dict[str, Any]], kind: str = "tune") -> Path:
    """Store ``rows`` (one per implementation and workload) for this device, keeping other devices' rows;
    one atomic rename, so a reader never sees half a file."""
    trace_key = key(implementation_keys)
    target = path(op, trace_key, kind)
    devices = {r["device_name"] for r in rows}
    old = read(op, trace_key, kind) or {}
    kept = [r for r in old.get("rows", []) if r.get("device_name") not in devices]
    data = {
        "op": op, "kind": kind, "key": trace_key, "torch": torch.__version__, "cuda": torch.version.cuda,
        "implementations": implementation_keys, "rows": kept + rows,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, target)
    return target


Choice = tuple[str, torch.dtype, Bucket]


def choices(data: dict[str, Any], never: dict[Choice, set[str]] | None = None) -> dict[Choice, str]:
    """(device type, dtype, bucket) -> the fastest implementation that passed every workload of that
    bucket on this machine's device. An implementation that failed one workload of a bucket is never
    chosen for it, nor one that ``never`` names for it (``excluded`` of the rows that count)."""
    groups: dict[Choice, dict[str, list[float] | None]] = {}
    for r in _here(data):
        where = (r["device"], getattr(torch, r["dtype"]), tuple(r["bucket"]))
        times = groups.setdefault(where, {})
        name = r["implementation"]
        if r["status"] != "PASSED" or r.get("us") is None or times.get(name, []) is None:
            times[name] = None  # failed (or untimed) somewhere in the bucket
        else:
            times.setdefault(name, []).append(float(r["us"]))
    table = {}
    for where, times in groups.items():
        passed = {name: sum(t) for name, t in times.items() if t and name not in (never or {}).get(where, ())}
        if passed:
            table[where] = min(passed, key=passed.__getitem__)
    return table


def excluded(rows: list[dict[str, Any]]) -> dict[Choice, set[str]]:
    """(device type, dtype, bucket) -> implementations that failed a workload of it (in ``records``' rows):
    never sent there."""
    out: dict[Choice, set[str]] = {}
    for r in rows:
        if r["status"] != "PASSED":
            out.setdefault((r["device"], getattr(torch, r["dtype"]), tuple(r["bucket"])), set()).add(r["implementation"])
    return out


def excluded_elsewhere(rows: list[dict[str, Any]]) -> dict[tuple, set[str]]:
    """For calls of buckets no workload had: (device type, dtype, last dim a multiple of 8) ->
    implementations that failed a workload of that dtype and kind of width (at any size: a kernel wrong at
    odd widths is not trusted with odd widths it was not tried on); (device type,) -> implementations that
    passed no workload on that device (the empty ones aside: any function passes those)."""
    out: dict[tuple, set[str]] = {}
    tried, passed = set(), set()
    for r in rows:
        name, device = r["implementation"], r["device"]
        tried.add((device, name))
        if r["status"] != "PASSED":
            out.setdefault((device, getattr(torch, r["dtype"]), r["bucket"][1]), set()).add(name)
        elif r["bucket"][0] > 0:
            passed.add((device, name))
    for device, name in tried - passed:
        out.setdefault((device,), set()).add(name)
    return out


def buckets(rows: list[dict[str, Any]]) -> set[Choice]:
    """The (device type, dtype, bucket)s that a workload had."""
    return {(r["device"], getattr(torch, r["dtype"]), tuple(r["bucket"])) for r in rows}


def _here(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows taken on this machine's kind of device (a GPU of the same name, a CPU of the same model)."""
    def here(r: dict[str, Any]) -> bool:
        visible = r["device"] == "cpu" or (r["device"] == "cuda" and torch.cuda.is_available())
        return visible and r.get("device_name") == device_name(r["device"])

    return [r for r in data.get("rows", []) if here(r)]
