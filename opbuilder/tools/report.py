"""``opbuilder report``: what works on this machine and why not, and what the cache holds.

Also the facts ``opbuilder clean`` decides with: whether a key's lock is held, and why a cached build
is stale. Importing this module imports no torch and touches no GPU; ``collect()`` imports torch and
queries the GPUs through ``torch.cuda`` only when ``torch.cuda.is_available()`` says there are some.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from opbuilder import env, paths
from opbuilder.errors import OpBuilderError
from opbuilder.jit import cache, fingerprint, registry, remote, toolchain
from opbuilder.jit.builder import OpBuilder
from opbuilder.paths import PACKAGE_DIR

# ---- facts about the cache ----------------------------------------------------------------------


def lock_held(lock_path: Path) -> bool | None:
    """True when another process holds this build lock (it is building that key), False when free,
    None when it cannot be told (an unreadable cache, or a lock file that is a symbolic link: locks are
    never opened through one). Never waits, never creates the lock file."""
    if lock_path.is_symlink():
        return None
    if not lock_path.exists():
        return False
    from opbuilder.jit.locks import FileLock, Timeout

    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    except (OSError, OpBuilderError):  # unreadable, or a filesystem without flock
        return None
    lock.release()
    return False


def tree_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


def human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def cached_ops(root: Path) -> list[str]:
    """Names of the ops with a folder in the cache (built-in or the user's)."""
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def cached_keys(op_dir: Path) -> list[Path]:
    """The published builds of one op (its key folders), temporary build folders aside."""
    try:
        return sorted(p for p in op_dir.iterdir() if p.is_dir() and not p.name.startswith(cache.TMP_PREFIX))
    except OSError:
        return []


def stray_tmp_dirs(op_dir: Path) -> list[Path]:
    """Temporary build folders that no live build owns (a killed build leaves one): those whose key's
    lock is free. A folder whose key is being built is that build's, not stray."""
    try:
        tmp = sorted(p for p in op_dir.iterdir() if p.name.startswith(cache.TMP_PREFIX) and p.is_dir())
    except OSError:
        return []
    stray = []
    for path in tmp:
        key = path.name[len(cache.TMP_PREFIX):].split("-")[0]
        if lock_held(paths.lock(op_dir.name, key)) is False:
            stray.append(path)
    return stray


def _compiler_gone(ident: Any) -> str | None:
    if not isinstance(ident, dict) or "path" not in ident:
        return None
    try:
        st = os.stat(ident["path"])
    except OSError:
        return f"its compiler {ident['path']} is gone"
    if st.st_size != ident.get("size") or st.st_mtime_ns != ident.get("mtime_ns"):
        return f"its compiler {ident['path']} has changed"
    return None


def stale_reason(manifest: dict | None, builder: OpBuilder | None, here: dict[str, Any]) -> str | None:
    """Why a cached build can never be loaded again in this environment; None when it still can.

    Stale: another torch or Python, a compiler that is gone or changed, another CPU (for
    ``-march=native`` builds) and, for a built-in op, sources or builder VERSION that changed since.
    Another TORCH_CUDA_ARCH_LIST or flags of the same sources are not stale: they can be asked for again.
    """
    if manifest is None:
        return "its manifest is missing or unreadable"
    inputs = manifest.get("inputs")
    if not isinstance(inputs, dict):
        return "its manifest records no key inputs"
    abi = str(inputs.get("abi", ""))
    if abi.startswith("stable"):  # serves every torch of its ABI range: from its target on
        major, _, minor = abi.removeprefix("stable-").partition(".")
        target = (int(major), int(minor)) if major.isdigit() and minor.isdigit() else toolchain.STABLE_ABI_TARGET
        if target > toolchain.torch_version():
            return f"built for the stable API of torch {target[0]}.{target[1]}, newer than this torch"
        here = toolchain.abi_environment(True, target)
    for name, value in here.items():
        if inputs.get(name) != value:
            return f"built for {name} {inputs.get(name)}, this environment has {value}"
    for field in ("cxx", "nvcc"):
        why = _compiler_gone(inputs.get(field))
        if why:
            return why
    if inputs.get("cpu_isa") is not None and inputs["cpu_isa"] != toolchain.cpu_isa():
        return "built with -march=native for another CPU"
    if builder is not None:
        if inputs.get("builder_version") != builder.VERSION:
            return f"built by builder VERSION {inputs.get('builder_version')}, the op's is now {builder.VERSION}"
        files = fingerprint.project_files(builder.all_sources(), builder._include_dirs())
        current = fingerprint.digest_files(files, builder.digest_roots())
        changed = sorted(n for n, digest in (inputs.get("files") or {}).items() if current.get(n) != digest)
        if changed:
            return f"its sources changed since ({', '.join(changed[:3])})"
    return None


# ---- the report ---------------------------------------------------------------------------------


def _run_version(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in (out.stdout or out.stderr).splitlines() if ln.strip()]
    return lines[0].strip() if lines else None


def _tool(path: str | None) -> dict[str, Any]:
    if path is None:
        return {"path": None, "version": None}
    try:
        return {"path": path, "version": toolchain.compiler_identity(path)["version"]}
    except OSError as exc:
        return {"path": path, "version": f"unusable: {exc}"}


def versions() -> dict[str, Any]:
    import torch

    ninja = toolchain.which("ninja")
    return {
        "opbuilder": {"version": _opbuilder_version(), "path": str(PACKAGE_DIR)},
        "python": {"version": platform.python_version(), "path": sys.executable},
        "torch": {"version": torch.__version__, "path": str(Path(torch.__file__).parent), "git": torch.version.git_version},
        "cuda_runtime": {"version": torch.version.cuda, "note": None if torch.version.cuda else "torch built without CUDA"},
        "nvcc": _tool(toolchain.nvcc_path()),
        "host_compiler": _tool(toolchain.cxx_path()),
        "ninja": {"path": ninja, "version": _run_version([ninja, "--version"]) if ninja else None},
        "platform": platform.platform(),
    }


def _opbuilder_version() -> str:
    import opbuilder

    return getattr(opbuilder, "__version__", "unknown")


def gpus() -> dict[str, Any]:
    """The visible GPUs and the archs builds target. Queries devices only when torch.cuda says some
    are available (that query initialises CUDA in this process, never at import)."""
    import torch

    out: dict[str, Any] = {"devices": [], "note": None, "target_archs": [], "target_note": None}
    if torch.version.cuda is None:
        out["note"] = "torch was built without CUDA"
    elif not torch.cuda.is_available():
        out["note"] = "torch.cuda.is_available() is False"
    else:
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            out["devices"].append({"index": i, "name": torch.cuda.get_device_name(i), "arch": f"{major}.{minor}"})
    try:
        out["target_archs"] = toolchain.cuda_archs()
        source = "TORCH_CUDA_ARCH_LIST" if env.cuda_arch_list() else "the visible GPUs"
        out["target_note"] = f"from {source}" if out["target_archs"] else "none: no GPU visible and TORCH_CUDA_ARCH_LIST unset"
    except ValueError as exc:
        out["target_note"] = str(exc)
    return out


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(epoch))


def op_row(name: str, here: dict[str, Any] | None = None) -> dict[str, Any]:
    """One built-in op: compatible (or why not), prebuilt, cached for this key (or why its build there is
    corrupt), being built, last build; and in its cache folder the stale builds of other keys (why each)
    and stray temporary build folders. ``here``: ``toolchain.torch_environment()``, computed when None."""
    row: dict[str, Any] = {
        "op": name,
        "compatible": False,
        "reasons": [],
        "cuda": None,
        "prebuilt": None,
        "key": None,
        "cached": False,
        "corrupt": None,
        "cache_path": None,
        "building": None,
        "last_build": None,
        "log": None,
        "other_builds": 0,
        "stale": [],
        "stray_tmp": [],
    }
    try:
        builder = registry.get_builder(name)
    except Exception as exc:  # a broken builder is a row of the report, not the end of it
        row["reasons"] = [f"its builder failed to import: {type(exc).__name__}: {exc}"]
        return row
    try:
        _fill(row, builder, toolchain.torch_environment() if here is None else here)
    except (ValueError, OpBuilderError) as exc:  # e.g. a malformed TORCH_CUDA_ARCH_LIST, an unusable cache
        row["compatible"] = False
        row["reasons"] = [str(exc)]
    return row


def _fill(row: dict[str, Any], builder: OpBuilder, here: dict[str, Any]) -> None:
    from opbuilder.jit import prebuilt

    name = builder.name
    reasons = builder.incompatibility_reasons()
    row["reasons"] = reasons
    row["compatible"] = not reasons
    skip = builder.cuda_skip_reason()
    row["cuda"] = {"built": skip is None, "archs": builder.cuda_archs() if skip is None else [], "why_not": skip}
    wanted = builder.prebuilt_wanted()
    artifact, record, why = prebuilt.find(wanted)
    if artifact is not None:
        row["prebuilt"] = {"usable": True, "path": str(artifact), "why_not": None}
    elif record is not None or why is not None:
        row["prebuilt"] = {"usable": False, "path": str(wanted.folder if wanted else builder.prebuilt_dir()), "why_not": why}
    if reasons:
        return
    slot = cache.Slot(name, builder.key)
    row["key"] = builder.key
    row["cache_path"] = str(slot.path)
    artifact, manifest, why = cache.check_build(slot.path)
    row["cached"] = artifact is not None
    if artifact is None and slot.path.exists():  # a build is there but cannot be loaded: the next load rebuilds
        row["corrupt"] = why
    row["building"] = lock_held(slot.lock_path)
    failure = cache.read_failure(slot)
    if manifest is not None:
        row["last_build"] = {"ok": True, "at": manifest.get("built_at"), "seconds": manifest.get("build_seconds")}
        row["log"] = str(slot.path / manifest.get("log", cache.LOG))
    elif failure is not None:
        when = failure["time"]
        row["last_build"] = {"ok": False, "at": _when(when) if when is not None else None, "seconds": None}
        row["log"] = failure.get("log")
    others = [p for p in cached_keys(slot.op_dir) if p.name != slot.key]
    row["other_builds"] = len(others)
    for path in others:
        stale = stale_reason(cache.read_manifest(path), builder, here)
        if stale is not None:
            row["stale"].append({"key": path.name, "path": str(path), "reason": stale})
    row["stray_tmp"] = [str(p) for p in stray_tmp_dirs(slot.op_dir)]


def collect() -> dict[str, Any]:
    """Everything the report shows, JSON-able."""
    root = paths.root()
    here = toolchain.torch_environment()
    ops = [op_row(name, here) for name in registry.names()]
    user_ops = {op: len(cached_keys(paths.op_dir(op))) for op in cached_ops(root) if op not in registry.BUILDERS}
    return {
        "versions": versions(),
        "gpus": gpus(),
        "cache": {
            "root": str(root),
            "exists": root.is_dir(),
            "size_bytes": tree_size(root) if root.is_dir() else 0,
            "writable": os.access(root, os.W_OK) if root.is_dir() else None,
            "user_ops": user_ops,
        },
        "remote": remote.describe(),
        "ops": ops,
    }


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _remote_text(r: dict[str, Any] | None) -> str:
    """The remote tier in one line: where, reachable, what this process fetched and built."""
    if r is None or not r["configured"]:
        return "none"
    if r["reachable"] is None:
        return f"{r['where'] or ''}  NOT USED: {r['why_not']}".strip()
    counts = f"this process: {r['hits']} hits, {r['misses']} misses, {r['uploads']} uploads, {r['refused']} refused"
    if not r["reachable"]:
        return f"{r['where']}  UNREACHABLE: {r['why_not']}; {counts}"
    return f"{r['where']}  reachable, {r['entries']} entries under {r['prefix']}; {counts}"


def render(data: dict[str, Any]) -> str:
    v, g, c = data["versions"], data["gpus"], data["cache"]

    def tool(entry: dict[str, Any]) -> str:
        if entry.get("path") is None:
            return "not found"
        return f"{entry.get('version') or '?'}  ({entry['path']})"

    gpu_text = ", ".join(f"{d['index']}: {d['name']} (sm {d['arch']})" for d in g["devices"]) or f"none ({g['note']})"
    archs = ",".join(g["target_archs"]) or "none"
    lines = [
        f"opbuilder {v['opbuilder']['version']}  ({v['opbuilder']['path']})",
        f"  python          {v['python']['version']}  ({v['python']['path']})",
        f"  torch           {v['torch']['version']}  ({v['torch']['path']})",
        f"  CUDA runtime    {v['cuda_runtime']['version'] or 'none: ' + str(v['cuda_runtime']['note'])}",
        f"  nvcc            {tool(v['nvcc'])}",
        f"  host compiler   {tool(v['host_compiler'])}",
        f"  ninja           {tool(v['ninja'])}",
        f"  GPUs            {gpu_text}",
        f"  target archs    {archs}  ({g['target_note']})",
        f"  cache           {c['root']}  ({human(c['size_bytes'])}"
        + ("" if c["exists"] else ", not created yet")
        + (", NOT WRITABLE" if c["writable"] is False else "")
        + ")  [OPB_CACHE_DIR]",
        f"  remote cache    {_remote_text(data.get('remote'))}  [OPB_REMOTE_CACHE]",
        "",
    ]
    header = ("op", "compatible", "prebuilt", "cached", "building", "last build")
    rows = []
    notes = []
    for r in data["ops"]:
        if r["compatible"]:
            compat = "yes" + ("" if r["cuda"]["built"] else " (cpu)")
        else:
            compat = "NO"
            notes.append(f"{r['op']}: " + "; ".join(r["reasons"]))
        if r["compatible"] and not r["cuda"]["built"]:
            notes.append(f"{r['op']}: CPU only: {r['cuda']['why_not']}")
        pb = r["prebuilt"]
        prebuilt_text = "-" if pb is None else ("yes" if pb["usable"] else "not used")
        if pb is not None and not pb["usable"]:
            notes.append(f"{r['op']}: prebuilt library not used: {pb['why_not']}")
        last = r["last_build"]
        last_text = "-"
        if last is not None:
            last_text = f"{last['at'] or 'at an unknown time'}" + (f" ({last['seconds']} s)" if last["seconds"] is not None else "")
            last_text += "" if last["ok"] else " FAILED"
        if r["log"]:
            notes.append(f"{r['op']}: log {r['log']}")
        if r["corrupt"]:
            notes.append(f"{r['op']}: CORRUPT build at {r['cache_path']}: {r['corrupt']} (the next load rebuilds it)")
        for stale in r["stale"]:
            notes.append(f"{r['op']}: STALE build {stale['key']}: {stale['reason']} "
                         "(`opbuilder clean --stale` removes it)")
        if r["other_builds"]:
            notes.append(f"{r['op']}: {r['other_builds']} other build(s) in the cache (see `opbuilder clean --stale`)")
        for path in r["stray_tmp"]:
            notes.append(f"{r['op']}: STRAY temporary build folder {path}, left by a build that ended early (the "
                         f"next build of its key removes it; so does `opbuilder clean {r['op']}`, with its builds)")
        cached = "CORRUPT" if r["corrupt"] else _yes_no(r["cached"])
        rows.append((r["op"], compat, prebuilt_text, cached if r["key"] else "-",
                     _yes_no(r["building"]) if r["key"] else "-", last_text))
    widths = [max(len(str(x[i])) for x in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
    if c["user_ops"]:
        lines.append("")
        lines.append("user ops in the cache: " + ", ".join(f"{op} ({n} build(s))" for op, n in c["user_ops"].items()))
    if notes:
        lines.append("")
        lines.extend(notes)
    return "\n".join(lines)
