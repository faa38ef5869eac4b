"""The one sequence that builds and loads an op, ``build_and_load(spec)``:

    prebuilt -> cache -> compatibility -> lock -> re-check -> build -> publish -> load

1. an install-time build that fits this process (``opbuilder.jit.prebuilt``);
2. a good build of the key in the cache: loaded without a lock (the warm path);
3. otherwise the op must be buildable here (``IncompatibleOpError`` says why not), unless a remote cache
   tier is configured (``OPB_REMOTE_CACHE``): then that is asked first, under the lock (step 5);
4. take the key's lock (another process may be building it: wait, up to ``OPB_LOCK_TIMEOUT``);
5. look again: what we waited for may be there now (or its error, which is raised); then the remote tier,
   if any (``opbuilder.jit.remote``): another node's build is downloaded, or this one builds under the
   cluster's lease and shares it;
6. build into a temporary folder: the compile runs from this process through ninja, on the build file
   torch.utils.cpp_extension writes (``opbuilder.jit.compile``); an edit recompiles only what it touched;
7. publish with one atomic rename;
8. load the library that was checked.

``OpBuilder.load()`` and ``opbuilder.prepare()`` (which stops before step 8) run it; the install-time
build compiles the same spec (``extension``). The cache is looked at twice: before the lock and under it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from opbuilder import env, paths
from opbuilder.errors import BuildError, CacheError, CacheLockTimeout, IncompatibleOpError, SourcesChanged
from opbuilder.jit import cache, loader, toolchain
from opbuilder.jit.log import say

if TYPE_CHECKING:
    from opbuilder.jit import prebuilt
    from opbuilder.jit.locks import FileLock

__all__ = ["BuildSpec", "Built", "Ready", "SourcesChanged", "build_and_load", "ensure_built", "extension", "say"]


class BuildSpec(NamedTuple):
    """Everything one build needs; produced by ``OpBuilder.build_spec()`` and not changed afterwards (a
    NamedTuple, as the two below: a dataclass costs a millisecond to make at import, on every warm path)."""

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
    inputs: dict[str, Any] = {}  # a default shared by the specs that take it: never changed, as every field
    project_files: list[str] = []  # sources and the headers they include
    digest_roots: list[str] = []  # how inputs["files"] names them
    reason: str | None = None  # why this build happens, when the caller knows
    skipped: str | None = None  # sources left out of this build and why ("kernel.cu: torch was built without CUDA")
    #: an install-time build to try first (built-in ops only)
    prebuilt: prebuilt.Wanted | None = None
    #: why the op cannot be built here (empty when it can); asked only when the cache has no build
    incompatible: Callable[[], list[str]] = lambda: []
    #: the spec again from the files as they are now (they changed during the build); None: not possible
    rekey: Callable[[], BuildSpec] | None = None


class Ready(NamedTuple):
    """What ``build_and_load(spec, load=False)`` found or did: ``how`` is "prebuilt", "cached" or "built"."""

    how: str
    path: Path


def build_and_load(spec: BuildSpec, load: bool = True) -> Any:
    """The loaded op (``load=False``: a ``Ready`` saying where a loadable library is), building it first
    when neither an install-time build nor the cache has one.

    Raises IncompatibleOpError when it cannot be built here, CacheError when the cache folder is unusable
    or unsafe, CacheLockTimeout when another process holds the key's lock past OPB_LOCK_TIMEOUT,
    BuildError when the compile fails (here or in the process we waited for) or when the sources kept
    changing while it was built.
    """
    for attempt in range(3):
        try:
            return _sequence(spec, load)
        except SourcesChanged as changed:
            if spec.rekey is None or attempt == 2:
                raise BuildError(f"opbuilder: the sources of {spec.op!r} kept changing while it was built "
                                 f"({changed}); nothing was published") from None
            say(f"{spec.op}: {changed}; keying it again")
            spec = spec.rekey()
    raise AssertionError("unreachable")


def _sequence(spec: BuildSpec, load: bool) -> Any:
    # 1. prebuilt (a module imported only where there is one to look at)
    if spec.prebuilt is not None:
        from opbuilder.jit import prebuilt

        if load:
            handle = prebuilt.load(spec.prebuilt)
            if handle is not None:
                return handle
        else:
            artifact = prebuilt.find(spec.prebuilt)[0]
            if artifact is not None:
                return Ready("prebuilt", artifact)
    # 2. cache
    slot = cache.Slot(spec.op, spec.key)
    unloadable = None
    if load:
        handle, unloadable = loader.load_cached(spec.op, spec.key)
        if handle is not None:
            return handle
    elif cache.check_build(slot.path)[0] is not None:
        return Ready("cached", slot.path)
    # 3. compatibility: an op that cannot be built here is an error now; with a remote cache tier
    #    (OPB_REMOTE_CACHE), only once that has no build either (a node without a compiler loads another's)
    reasons = spec.incompatible()
    if reasons and env.remote_cache_url() is None:
        raise _incompatible(spec, reasons)
    # 4.-7. lock, re-check, build, publish
    built = ensure_built(spec, reject_build_id=unloadable, cannot_build=reasons)
    if not load:
        return Ready("built", built.path)
    # 8. load
    try:
        return loader.load_artifact(spec.op, spec.key, built.artifact, built.manifest)
    except (OSError, ImportError) as exc:
        if built.artifact.exists():
            raise BuildError(_load_failure(spec, built.artifact, exc)) from exc
    # Removed between our lock's release and the load (`opbuilder clean`): build it once more.
    built = ensure_built(spec)
    try:
        return loader.load_artifact(spec.op, spec.key, built.artifact, built.manifest)
    except (OSError, ImportError) as exc:
        raise BuildError(_load_failure(spec, built.artifact, exc)) from exc


def extension(spec: BuildSpec, key: str) -> Any:
    """A setuptools extension compiling ``spec`` at install time (``opbuilder.jit.prebuild``): portable (no
    ``-march``), named and namespaced by ``key``, the prebuilt key, so it never collides with a JIT build."""
    cpp = toolchain.cpp_extension(cuda=spec.with_cuda)
    ns_flag = f"-DOPB_NAMESPACE=opb_{spec.op}_{key[:12]}"
    kwargs: dict[str, Any] = {
        "name": f"opbuilder._prebuilt.{spec.op}.{spec.op}_{key[:12]}",
        "sources": list(spec.sources),
        "include_dirs": list(spec.include_paths),
        "extra_link_args": list(spec.ldflags),
    }
    cxx = [a for a in spec.cxx_args if not a.startswith("-march=")] + [ns_flag]
    if spec.with_cuda:
        return cpp.CUDAExtension(**kwargs, extra_compile_args={"cxx": cxx, "nvcc": spec.nvcc_args + [ns_flag]})
    return cpp.CppExtension(**kwargs, extra_compile_args={"cxx": cxx})


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


class Built(NamedTuple):
    """A good build of a key: its folder, its library and its manifest (as checked)."""

    path: Path
    artifact: Path
    manifest: dict


def _incompatible(spec: BuildSpec, reasons: list[str]) -> IncompatibleOpError:
    return IncompatibleOpError(f"op {spec.op!r} cannot be built here: " + "; ".join(reasons))


def ensure_built(spec: BuildSpec, reject_build_id: str | None = None, cannot_build: list[str] = ()) -> Built:
    """Steps 4 to 7: a good build of ``spec``'s key, built under the key's lock unless one is there
    once the lock is ours.

    ``reject_build_id`` names a build found not to load: it is rebuilt unless another process
    already replaced it. ``cannot_build``: why this process cannot compile the op (it may still find a
    build: someone else's, or the remote tier's). Raises as ``build_and_load`` does.
    """
    from opbuilder.jit.locks import FileLock

    slot = cache.Slot(spec.op, spec.key)

    cache.ensure_dir(slot.op_dir)
    cache.check_trusted(slot)
    cache.refuse_symlink(slot.lock_path)
    lock = FileLock(str(slot.lock_path))
    waited_since = time.time()
    waited = _hold(lock, spec.op, "build lock")
    try:
        good = _good_build(slot, reject_build_id)
        if good is not None:
            return good
        failure = cache.read_failure(slot)
        if waited and failure is not None and failure["time"] is not None and failure["time"] >= waited_since:
            raise BuildError(f"{failure.get('message')}\n(built by process {failure.get('pid')} while this one waited)")
        # --- remote tier (opbuilder.jit.remote, OPB_REMOTE_CACHE): download another node's build, or build
        # under the cluster's lease and share it; without one, build here.
        from opbuilder.jit import remote

        def build_here() -> Built:
            if cannot_build:
                raise _incompatible(spec, list(cannot_build))
            return _build(spec, slot)

        tier = remote.tier(say)
        if tier is not None:
            path = tier.obtain(slot, lambda: build_here().path, say, reject_build_id)
            good = _good_build(slot, None)
            if good is None:
                raise BuildError(f"opbuilder: the build of {spec.op} in {path} is unusable")
            return good
        return build_here()
    finally:
        lock.release()


def _good_build(slot: cache.Slot, reject_build_id: str | None) -> Built | None:
    artifact, manifest, _why = cache.check_build(slot.path)
    if artifact is None or manifest is None:
        return None
    if reject_build_id is not None and str(manifest.get("build_id")) == reject_build_id:
        return None
    cache.check_trusted(slot, artifact)
    return Built(slot.path, artifact, manifest)


def _hold(lock: FileLock, op: str, what: str) -> bool:
    """Acquire ``lock`` (a build's), waiting up to ``OPB_LOCK_TIMEOUT`` while another process holds it, and
    stopping at once on Ctrl-C; True when it had to wait. Raises CacheLockTimeout naming the lock file."""
    from opbuilder.jit import compile
    from opbuilder.jit.locks import Timeout

    deadline = time.time() + env.lock_timeout()
    waited = False
    while True:
        try:
            lock.acquire(timeout=0 if not waited else max(0.0, min(0.5, deadline - time.time())))
            return waited
        except Timeout:
            if not waited:
                say(f"waiting for another process building {op} ({what} {lock.path})")
                waited = True
            compile.raise_if_cancelled()  # Ctrl-C while waiting: stop now
            if time.time() >= deadline:
                raise CacheLockTimeout(
                    f"opbuilder: gave up after {env.lock_timeout():.0f} s waiting for the {what} {lock.path} "
                    f"of op {op!r}; another process is still building it. Raise OPB_LOCK_TIMEOUT to wait longer."
                ) from None


def _build(spec: BuildSpec, slot: cache.Slot) -> Built:
    from opbuilder.jit.locks import FileLock

    from opbuilder.jit import compile

    cache.remove_stray_tmp_dirs(slot)
    targets = "cpu" + (f" + cuda {','.join(spec.archs)}" if spec.with_cuda else "")
    say(f"building {spec.op} ({targets}): {spec.reason or _reason(spec, slot)}")
    started = time.time()
    work = compile.work_dir(spec.op, spec.inputs)
    tmp_dir = slot.new_tmp_dir()
    try:
        # the work folder's objects are shared by the op's keys: another key's build may be compiling there
        work_lock = FileLock(str(paths.work_lock(work)))
        _hold(work_lock, spec.op, "work folder's lock")
        with work_lock:
            try:
                result = compile.build(spec, say)
            except OSError as exc:  # the snapshot or the work folder could not be written
                raise cache.cache_error(work, exc, folder=True) from exc
            except compile.CompileFailed as failed:
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
        return Built(published, published / artifact.name, manifest)
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
