"""The small JSON records ``opbuilder check`` and ``opbuilder tune`` leave in the cache, and what dispatch
reads from them.

``<cache root>/traces/<op>/<key>.json`` (``opbuilder.paths.trace``) (tune: statuses and times) and ``<key>.check.json`` (check:
statuses). The key hashes torch's and CUDA's versions and every implementation's key, so editing a
kernel, adding an implementation or upgrading torch starts a new trace; rows carry their device's name,
so one file holds the runs of several devices. A shape bucket is what ``bucket()`` makes of the call's
first tensor: its size class (the bit length of its element count) and whether its last dim is a
multiple of 8 (the widths the vectorised paths take).

A trace decides which code gets each call, so it is trusted as a library in the cache is: unless
``OPB_TRUST_SHARED_CACHE=1``, it and every folder on the way to it must pass ``cache.chain_problem`` (owned
by this user or root, not writable by group or others), the same check the loader makes; a trace that
fails it could have been planted by another member of a group-writable cache, and is ignored with one
``TraceWarning`` naming it. Ignoring (rather than the loader's error) is enough because a trace only
chooses among the implementations registered in code, and costs nothing but speed. Then it is read as
untrusted data all the same: one of another shape than ``write`` makes is ignored with one warning too,
and the op's calls go as with no trace. Traces are written as the cache's other files are
(``cache.write_text_atomic``): private folders and files, or in a shared cache the group's to read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import stat
import warnings
from pathlib import Path
from typing import Any

import torch

from opbuilder import env, paths
from opbuilder.jit import cache
from opbuilder.errors import CacheError, TraceWarning

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
    return paths.trace(op, trace_key, kind)


def any_for(op: str) -> bool:
    """Whether check or tune ever left a trace of ``op`` in this cache: a trace file in its folder. A folder
    holding only locks (a write that failed after taking its key's lock: a full disk, a kill) or nothing is
    none, so later processes keep the first call's short road. A folder that cannot be listed counts, for
    the reader to say why it is skipped."""
    try:
        with os.scandir(paths.traces(op)) as entries:
            return any(e.name.endswith(".json") for e in entries)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True


def read(op: str, trace_key: str, kind: str = "tune") -> dict[str, Any] | None:
    return _read_dated(op, trace_key, kind)[0]


def _read_dated(op: str, trace_key: str, kind: str) -> tuple[dict[str, Any] | None, int]:
    """(the record, or None; its file's modification time in ns, 0 when there is none).

    None, with one TraceWarning naming the file, for a trace someone else could have written or one of
    the wrong shape (see the module's docstring)."""
    where = path(op, trace_key, kind)
    try:
        # not blocking: a FIFO planted there must not hang the op's first call (it is refused below)
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError as exc:  # there, but not this user's to read (a shared cache made before traces were shared)
        with contextlib.suppress(OSError):
            _ignore(where, os.stat(where), f"this user cannot read it ({exc.strerror}; its owner can chmod g+r it)")
        return None, 0
    except OSError:  # none (the usual case): as if none
        return None, 0
    try:
        fh = open(fd)
    except OSError as exc:  # a folder there (open() refuses it, and leaves the descriptor open)
        with contextlib.suppress(OSError):
            _ignore(where, os.fstat(fd), f"it is not a regular file ({exc.strerror})")
        os.close(fd)
        return None, 0
    with fh:
        st = os.fstat(fh.fileno())
        untrusted = None
        if not env.trust_shared_cache():  # the loader's check of a library: the path, then the open file
            try:
                untrusted = cache.chain_problem(where)
            except CacheError as exc:
                untrusted = str(exc)
            if untrusted is None and (problem := cache.trust_problem(st)) is not None:
                untrusted = f"{where} {problem}"
        if untrusted is not None:
            _ignore(where, st, f"{untrusted}, so someone else could have written it (OPB_TRUST_SHARED_CACHE=1 accepts it)")
            return None, 0
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES:
            _ignore(where, st, "it is not a regular file" if not stat.S_ISREG(st.st_mode) else f"it has {st.st_size} bytes")
            return None, 0
        try:
            data = json.load(fh)
        except (OSError, ValueError, RecursionError) as exc:
            _ignore(where, st, f"it is not JSON ({type(exc).__name__}: {str(exc)[:100]})")
            return None, 0
    problem = _shape_problem(data)
    if problem is not None:
        _ignore(where, st, f"it is not a trace opbuilder wrote: {problem}")
        return None, 0
    return data, st.st_mtime_ns


_WARNED: set[tuple[str, int, int]] = set()
_MAX_BYTES = 64 << 20  # a trace has a few rows per implementation and workload: far less than this


def _ignore(where: Path, st: os.stat_result, why: str) -> None:
    """One TraceWarning for this version of the file (later reads of it stay quiet)."""
    seen = (str(where), st.st_mtime_ns, st.st_size)
    if seen not in _WARNED:
        _WARNED.add(seen)
        warnings.warn(f"opbuilder: ignoring the trace {where}: {why}; calls go as with no trace. "
                      f"Remove it, or run opbuilder check/tune again to replace it.", TraceWarning, stacklevel=2)


_TEXT_FIELDS = ("implementation", "device", "device_name", "dtype", "status")


def _shape_problem(data: Any) -> str | None:
    """What in a parsed trace is not as ``write`` makes it (only what dispatch and report read); None when fine."""
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        return "it is not an object with a list of rows"
    for i, r in enumerate(data["rows"]):
        if not isinstance(r, dict):
            return f"row {i} is not an object"
        for field in _TEXT_FIELDS:
            if not isinstance(r.get(field), str):
                return f"row {i}: {field} {r.get(field)!r} is not a string"
        if r["device"] not in ("cpu", "cuda"):
            return f"row {i}: device {r['device']!r} is not cpu or cuda"
        if not isinstance(getattr(torch, r["dtype"], None), torch.dtype):
            return f"row {i}: dtype {r['dtype']!r} is not a torch dtype"
        b = r.get("bucket")
        if not (isinstance(b, list) and len(b) == 2 and type(b[0]) is int and 0 <= b[0] <= 64 and type(b[1]) is bool):
            return f"row {i}: bucket {b!r} is not [size class, width a multiple of 8]"
        us = r.get("us")
        if us is not None and not (type(us) in (int, float) and math.isfinite(us) and us >= 0):
            return f"row {i}: us {us!r} is not a time"
    return None


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
    one atomic rename, so a reader never sees half a file. The read and the rename are made under the key's
    lock (``paths.trace_lock``), so two writers at once (two nodes' tunes on one cache) keep each other's rows.
    Raises CacheError when the lock cannot be had within ``OPB_LOCK_TIMEOUT``."""
    from opbuilder.jit.locks import FileLock, Timeout

    trace_key = key(implementation_keys)
    target = path(op, trace_key, kind)
    devices = {r["device_name"] for r in rows}
    lock = FileLock(paths.trace_lock(op, trace_key))
    try:
        lock.acquire(timeout=env.lock_timeout())
    except Timeout:
        raise CacheError(f"opbuilder: gave up after {env.lock_timeout():.0f} s waiting for {lock.path}, held by "
                         f"another process writing {op}'s trace; raise OPB_LOCK_TIMEOUT to wait longer") from None
    try:
        old = read(op, trace_key, kind) or {}
        kept = [r for r in old.get("rows", []) if r.get("device_name") not in devices]
        data = {
            "op": op, "kind": kind, "key": trace_key, "torch": torch.__version__, "cuda": torch.version.cuda,
            "implementations": implementation_keys, "rows": kept + rows,
        }
        cache.write_text_atomic(target, json.dumps(data, indent=1))  # private, or the group's in a shared cache
    finally:
        lock.release()
    return target


def check_writable(op: str) -> None:
    """Raises CacheError when ``op``'s traces cannot be written here (a read-only or full cache, a folder not
    this user's, a filesystem without file locks: LockUnsupported), as ``write`` would: asked before a check or
    tune runs every implementation, not after. Leaves nothing behind."""
    from opbuilder.jit.locks import FileLock

    probe = paths.traces(op) / f".probe-{os.getpid()}"
    written = False
    try:  # the folder too is made first: a full disk can refuse the file after it
        cache.write_text_atomic(probe, "a trace can be written here\n")
        written = True
        lock = FileLock(probe)  # write locks the key's traces: flock must work in this folder
        lock.acquire(timeout=0)
        lock.release()
    finally:
        if written:  # unlinking a probe never written fails on a read-only cache, hiding the CacheError
            probe.unlink()
        with contextlib.suppress(OSError):  # nothing left behind: a folder this made and no trace needs
            probe.parent.rmdir()


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
