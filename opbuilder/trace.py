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
import platform
from pathlib import Path
from typing import Any

import torch

from opbuilder import cache, env

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
    try:
        return json.loads(path(op, trace_key, kind).read_text())
    except (OSError, ValueError):
        return None


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
    # Whole or nothing, and a CacheError naming a full or read-only cache (no .tmp- file left behind).
    cache.write_text_atomic(target, json.dumps(data, indent=1))
    return target


Choice = tuple[str, torch.dtype, Bucket]


def choices(data: dict[str, Any]) -> dict[Choice, str]:
    """(device type, dtype, bucket) -> the fastest implementation that passed every workload of that
    bucket on this machine's device. An implementation that failed one workload of a bucket is never
    chosen for it."""
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
        passed = {name: sum(t) for name, t in times.items() if t}
        if passed:
            table[where] = min(passed, key=passed.__getitem__)
    return table


def excluded(data: dict[str, Any]) -> dict[Choice, set[str]]:
    """(device type, dtype, bucket) -> implementations that failed a workload of it: never sent there."""
    out: dict[Choice, set[str]] = {}
    for r in _here(data):
        if r["status"] != "PASSED":
            out.setdefault((r["device"], getattr(torch, r["dtype"]), tuple(r["bucket"])), set()).add(r["implementation"])
    return out


def _here(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows taken on this machine's kind of device (a GPU of the same name, a CPU of the same model)."""
    def here(r: dict[str, Any]) -> bool:
        visible = r["device"] == "cpu" or (r["device"] == "cuda" and torch.cuda.is_available())
        return visible and r.get("device_name") == device_name(r["device"])

    return [r for r in data.get("rows", []) if here(r)]
