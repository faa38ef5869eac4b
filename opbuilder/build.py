"""The one sequence that builds and loads an op.

try the cache -> take the lock -> try again -> build into a temporary folder -> publish with an
atomic rename -> load. The compile runs from this process through ninja, on the build file
torch.utils.cpp_extension writes (``opbuilder.compile``): no interpreter starts, nothing is loaded
before this process loads the published library, and an edit recompiles only what it touched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opbuilder import cache, compile as ninja_build, env, loader, remote
from opbuilder.compile import SourcesChanged
from opbuilder.errors import BuildError, CacheError, CacheLockTimeout

__all__ = ["BuildSpec", "SourcesChanged", "build_and_load", "ensure_built", "say"]


@dataclass
class BuildSpec:
    """Everything one build needs; produced by ``OpBuilder`` and not changed afterwards."""

    op: str
    key: str
    name: str  # extension module name (TORCH_EXTENSION_NAME): one per op, so a new key recompiles nothing
    namespace: str  # torch.ops namespace (TORCH_LIBRARY builds), compiled in by a generated file
    python_module: bool
    sources: list[str]
    include_paths: list[str]
    cxx_args: list[str]
    nvcc_args: list[str]
    ldflags: list[str]
    with_cuda: bool
    archs: list[str]
    inputs: dict[str, Any] = field(default_factory=dict)
    project_files: list[str] = field(default_factory=list)  # sources and the headers they include
    digest_roots: list[str] = field(default_factory=list)  # how inputs["files"] names them
    reason: str | None = None  # why this build happens, when the caller knows
    skipped: str | None = None  # sources left out of this build and why ("kernel.cu: torch was built without CUDA")


_SAY_LOCK = threading.Lock()


def say(message: str) -> None:
    """One whole line on stderr: lines of builds running at once never mix."""
    with _SAY_LOCK:
        sys.stderr.write(f"opbuilder: {message}\n")
        sys.stderr.flush()


def build_and_load(spec: BuildSpec) -> Any:
    """Return the loaded op, building it first when the cache has no good build of its key.

    Raises CacheError when the cache folder is unusable or unsafe, CacheLockTimeout when another
    process holds the key's lock past OPB_LOCK_TIMEOUT, BuildError when the compile fails (here or in
    the process we waited for).
    """
    handle, unloadable = loader.load_cached(spec.op, spec.key)
    if handle is not None:
        return handle
    build_dir = ensure_built(spec, reject_build_id=unloadable)
    artifact, manifest, why = cache.check_build(build_dir)
    if artifact is None or manifest is None:
        # Removed between our lock's release and this look (`opbuilder clean`): build it once more.
        build_dir = ensure_built(spec)
        artifact, manifest, why = cache.check_build(build_dir)
    if artifact is None or manifest is None:
        raise BuildError(f"opbuilder: the build of {spec.op} in {build_dir} is unusable: {why}")
    try:
        return loader.load_artifact(spec.op, spec.key, artifact, manifest)
    except (OSError, ImportError) as exc:
        raise BuildError(_load_failure(spec, artifact, exc)) from exc


_UNDEFINED = re.compile(r"undefined symbol: (\S+)")


def _load_failure(spec: BuildSpec, artifact: Path, exc: BaseException) -> str:
    """Why a library that compiled and linked does not load, with C++ names as written in the source."""
    text = str(exc)
    chain = [text]
    cause: BaseException | None = exc
    while cause is not None and len(chain) < 5:  # torch.ops.load_library wraps the loader's own error
        cause = cause.__cause__ or cause.__context__
        if cause is not None:
            chain.append(str(cause))
    missing = _UNDEFINED.search(" ".join(chain))
    if missing:
        symbol = _demangle(missing.group(1))
        return (
            f"opbuilder: op {spec.op!r} compiled, but its library does not load: it uses {symbol}, which no "
            f"source of the op and no library it links defines (declared but not defined? a source missing "
            f"from sources()?). Library: {artifact}" + (f"\nNot built here: {spec.skipped}" if spec.skipped else "")
        )
    return f"opbuilder: op {spec.op!r} compiled, but its library does not load: {text}"


def _demangle(symbol: str) -> str:
    tool = shutil.which("c++filt")
    if tool is None:
        return symbol
    try:
        out = subprocess.run([tool, symbol], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return symbol
    return out.stdout.strip() or symbol


def ensure_built(spec: BuildSpec, reject_build_id: str | None = None) -> Path:
    """The folder of a good build of ``spec``'s key, building it under the key's lock if needed.

    ``reject_build_id`` names a build found not to load: it is rebuilt unless another process
    already replaced it. Raises as ``build_and_load`` does.
    """
    slot = cache.Slot(spec.op, spec.key)
    if _good_build(slot, reject_build_id):
        return slot.path
    from opbuilder.locks import FileLock, Timeout

    cache.ensure_dir(slot.op_dir)
    cache.check_trusted(slot)
    cache.refuse_symlink(slot.lock_path)
    lock = FileLock(str(slot.lock_path), mode=cache.lock_mode())
    waited_since = time.time()
    deadline = waited_since + env.lock_timeout()
    waited = False
    while True:
        try:
            lock.acquire(timeout=0 if not waited else max(0.0, min(0.5, deadline - time.time())))
            break
        except Timeout:
            if not waited:
                say(f"waiting for another process building {spec.op} (lock {slot.lock_path})")
                waited = True
            ninja_build.raise_if_cancelled()  # Ctrl-C while waiting: stop now
            if time.time() >= deadline:
                raise CacheLockTimeout(
                    f"opbuilder: gave up after {env.lock_timeout():.0f} s waiting for the build lock {slot.lock_path} "
                    f"of op {spec.op!r}; another process is still building it. Raise OPB_LOCK_TIMEOUT to wait longer."
                ) from None
    try:
        if _good_build(slot, reject_build_id):
            return slot.path
        failure = cache.read_failure(slot)
        if waited and failure is not None and failure["time"] is not None and failure["time"] >= waited_since:
            raise BuildError(f"{failure.get('message')}\n(built by process {failure.get('pid')} while this one waited)")
        # --- remote tier (opbuilder.remote, OPB_REMOTE_CACHE): download another node's build, or build
        # under the cluster's lease and share it; without one, build here.
        tier = remote.tier(say)
        if tier is not None:
            return tier.obtain(slot, lambda: _build(spec, slot), say, reject_build_id)
        return _build(spec, slot)
    finally:
        lock.release()


def _good_build(slot: cache.Slot, reject_build_id: str | None) -> bool:
    artifact, manifest, _why = cache.check_build(slot.path)
    if artifact is None or manifest is None:
        return False
    if reject_build_id is not None and str(manifest.get("build_id")) == reject_build_id:
        return False
    cache.check_trusted(slot, artifact)
    return True


def _build(spec: BuildSpec, slot: cache.Slot) -> Path:
    from opbuilder.locks import FileLock

    cache.remove_stray_tmp_dirs(slot)
    targets = "cpu" + (f" + cuda {','.join(spec.archs)}" if spec.with_cuda else "")
    say(f"building {spec.op} ({targets}): {spec.reason or _reason(spec, slot)}")
    started = time.time()
    work = ninja_build.work_dir(spec.op, spec.inputs)
    tmp_dir = slot.new_tmp_dir()
    try:
        with FileLock(str(work) + ".lock", mode=cache.lock_mode()):
            try:
                result = ninja_build.build(spec, say)
            except OSError as exc:  # the snapshot or the work folder could not be written
                raise cache.cache_error(work, exc) from exc
            except ninja_build.CompileFailed as failed:
                log_text = failed.args[0]
                full = _DISK_FULL.search(log_text)
                if full:
                    raise CacheError(cache.full_message(slot.op_dir, full.group(0))) from None
                message = _failure_message(spec, log_text)
                log_path = cache.record_failure(slot, message, log_text)
                raise BuildError(f"{message}\nfull log: {log_path}") from None
            except BuildError as exc:
                cache.record_failure(slot, str(exc), "")
                raise
            if not result.artifact.is_file():
                raise BuildError(f"opbuilder: the build of {spec.op} finished without producing {result.artifact.name}")
            artifact = tmp_dir / f"{spec.name}_{spec.key[:12]}.so"
            try:
                shutil.copy2(result.artifact, artifact)
            except OSError as exc:  # a full disk, most likely: named as such; tmp_dir goes below
                raise cache.cache_error(slot.op_dir, exc) from exc
        try:
            (tmp_dir / cache.LOG).write_text(result.log)
        except OSError as exc:
            raise cache.cache_error(slot.op_dir, exc) from exc
        seconds = time.time() - started
        manifest = {
            "op": spec.op,
            "key": spec.key,
            "python_module": spec.python_module,
            "module_name": spec.name,
            "namespace": spec.namespace,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "build_started": started,
            "build_seconds": round(seconds, 2),
            "compiled": result.compiled,
            "built_with_torch": _torch_version(),  # what built it (a stable-ABI op also serves later ones)
            "build_id": uuid.uuid4().hex,
            "log": cache.LOG,
            "inputs": spec.inputs,
            **cache.describe_artifact(artifact),
        }
        try:
            published = cache.publish(slot, tmp_dir, manifest)
        except OSError as exc:
            raise cache.cache_error(slot.op_dir, exc) from exc
        say(f"built {spec.op} in {seconds:.1f} s ({len(result.compiled)} of {result.total} files compiled)")
        return published
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _torch_version() -> str:
    import torch

    return torch.__version__


def _reason(spec: BuildSpec, slot: cache.Slot) -> str:
    """Why this key is being built: what differs from the newest build of the op in the cache."""
    newest: dict | None = None
    newest_time = -1.0
    for manifest_path in slot.op_dir.glob(f"*/{cache.MANIFEST}"):
        manifest = cache.read_manifest(manifest_path.parent)
        when = manifest.get("build_started") if manifest else None
        if manifest and isinstance(manifest.get("inputs"), dict) and isinstance(when, (int, float)) and when > newest_time:
            newest, newest_time = manifest["inputs"], float(when)
    if newest is None:
        return "first build here"
    ours = spec.inputs
    files_a, files_b = newest.get("files") or {}, ours.get("files") or {}
    # By content: a file whose bytes the last build had under another name (a moved project) is no change.
    contents_a, contents_b = set(files_a.values()), set(files_b.values())
    changed = sorted(n for n, digest in files_b.items() if files_a.get(n) != digest and digest not in contents_a)
    if changed:
        more = f" and {len(changed) - 2} more" if len(changed) > 2 else ""
        return ", ".join(os.path.basename(n) for n in changed[:2]) + more + " changed"
    removed = sorted(n for n, digest in files_a.items() if n not in files_b and digest not in contents_b)
    if removed:
        return ", ".join(os.path.basename(n) for n in removed[:2]) + " no longer part of the op"
    if set(files_a) != set(files_b):
        moved = sorted(set(files_b) ^ set(files_a))
        return (f"the same files under other paths (e.g. {moved[0]}): their contents are unchanged")
    for name, label in (("abi", "torch ABI"), ("torch", "torch"), ("torch_cuda", "torch's CUDA"), ("python", "Python")):
        if newest.get(name) != ours.get(name):
            return f"{label} changed ({newest.get(name)} -> {ours.get(name)})"
    if any(newest.get(name) != ours.get(name) for name in ("cxx", "nvcc", "nvcc_host")):
        return "the compiler changed"
    if any(newest.get(name) != ours.get(name) for name in ("cxx_args", "nvcc_args", "ldflags", "cuda_archs")):
        return "flags or CUDA archs changed"
    return "another configuration of this op"


_DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded|File too large|File size limit exceeded")
_ERROR_LINE = re.compile(r"(error|Error:|fatal|undefined reference|FAILED:)")


def _failure_message(spec: BuildSpec, log_text: str) -> str:
    lines = log_text.splitlines()
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and "error_" not in ln][:6]
    command = ""
    for i, ln in enumerate(lines):
        if ln.startswith("FAILED:") and i + 1 < len(lines):
            command = lines[i + 1].strip()
            break
    first = "\n  ".join(errors) if errors else "\n  ".join(lines[-8:])
    text = f"opbuilder: building op {spec.op!r} failed:\n  {first}"
    if command:
        text += f"\nto reproduce, run the failed command:\n  {command}"
    return text
