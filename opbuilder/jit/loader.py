"""Loading a built artifact into this process: a dlopen of the very file that was checked."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from opbuilder.jit import cache

_LOADED: dict[tuple[str, str], Any] = {}

# Descriptors of the loaded artifacts (and of those whose load failed), kept open for the life of the
# process: the dynamic loader knows each library by the name it was opened with (/proc/self/fd/N) and
# would hand back the old library for a later dlopen of a reused N.
_PINNED: list[int] = []


def load_cached(op: str, key: str) -> tuple[Any | None, str | None]:
    """(the loaded op, None) when a good build of this key is in the cache; else (None, the build id
    of a build that is there but does not load, or None). Never builds, never locks: the warm path.

    Raises CacheError when the build is there but not safe to load (see ``cache.check_trusted``).
    """
    handle = _LOADED.get((op, key))
    if handle is not None:
        return handle, None
    slot = cache.Slot(op, key)
    artifact, manifest, _why = cache.check_build(slot.path)
    if artifact is None or manifest is None:
        return None, None
    cache.check_trusted(slot, artifact)
    try:
        return load_artifact(op, key, artifact, manifest), None
    except (OSError, ImportError):
        return None, str(manifest.get("build_id"))


def _fd_path(fd: int) -> str | None:
    path = f"/proc/self/fd/{fd}"
    return path if os.path.exists(path) else None


def load_artifact(op: str, key: str, artifact: Path, manifest: dict) -> Any:
    """Load a library registering Torch ops (returns its ``torch.ops`` namespace) or a Python
    extension module (returns the module).

    The file is opened without following links and checked open (``cache.open_artifact``), then loaded
    through its descriptor, so a file or folder swapped in after the check is never loaded. Raises
    CacheError when it is not safe to load, OSError or ImportError when the file is bad.
    """
    fd = cache.open_artifact(artifact, manifest)
    # Where /proc is missing the path is all there is: the checks above still ran on that file.
    via = _fd_path(fd) or str(artifact)
    try:
        handle = _load_python_module(manifest["module_name"], via, artifact) if manifest.get("python_module") \
            else _load_torch_library(via, artifact, manifest["namespace"], op)
    except BaseException:
        # Kept open too: the library may be mapped already (a module whose init raised, a namespace refused), and the
        # dynamic loader would hand it back for a later dlopen of a reused /proc/self/fd/N (a rebuild, the JIT build
        # after a prebuilt one failed) instead of loading that file.
        _PINNED.append(fd)
        raise
    _PINNED.append(fd)
    _LOADED[(op, key)] = handle
    return handle


def _load_python_module(name: str, via: str, artifact: Path) -> Any:
    # The file name has no extension suffix, so the loader is named rather than guessed from it.
    spec = importlib.util.spec_from_file_location(name, via, loader=importlib.machinery.ExtensionFileLoader(name, via))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {artifact} as module {name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__file__ = spec.origin = str(artifact)  # where it lives (repr, tracebacks), not /proc/self/fd/N
    sys.modules[name] = module
    return module


def _load_torch_library(via: str, artifact: Path, namespace: str, op: str) -> Any:
    import ctypes

    import torch

    # torch.ops.load_library(path) would resolve /proc/self/fd/N back to a path (realpath) and open
    # that: do what it does (a global dlopen, the path remembered) on the descriptor instead.
    try:
        from torch._ops import dl_open_guard
    except ImportError:  # a torch without it: RTLD_GLOBAL by hand
        dl_open_guard = _global_dlopen
    with dl_open_guard():
        try:
            ctypes.CDLL(via)
        except OSError as exc:
            raise OSError(f"could not load {artifact}: {exc}") from exc
    torch.ops.loaded_libraries.add(str(artifact))
    return getattr(torch.ops, registered_namespace(namespace, op, artifact))


def registered_namespace(namespace: str, op: str, artifact: Path) -> str:
    """The namespace whose ops a just loaded library of ``op`` registered: the build's own (``OPB_LIBRARY``),
    or the one other name it registered instead (``TORCH_LIBRARY(TORCH_EXTENSION_NAME, m)``, kernel-builder's
    ``STABLE_TORCH_LIBRARY_EXPAND``, a literal ``OPB_NAMESPACE``). Raises BuildError when it registered ops
    under several other namespaces and none under its own."""
    import torch

    try:  # one lookup when an op of the build's namespace bears the op's name (opbuilder's own form)
        torch._C._dispatch_find_schema_or_throw(f"{namespace}::{op}", "")
        return namespace
    except RuntimeError:
        pass
    names = torch._C._dispatch_get_all_op_names()
    if any(name.startswith(namespace + "::") for name in names):
        return namespace
    # Registered elsewhere: the namespaces whose schemas were registered from this op's sources (each
    # registration records the file it was made in: the op's work folder, or its own source folder).
    from opbuilder import paths

    where = f"{os.sep}{paths.work_root().name}{os.sep}{op}-"
    found: dict[str, None] = {}
    for name in names:
        ns = name.partition("::")[0]
        if ns in found or ns in ("aten", "prim", "prims") or ":" not in name:
            continue
        debug = next((ln for ln in torch._C._dispatch_dump(name).splitlines() if ln.startswith("debug:")), "")
        if where in debug:
            found[ns] = None
    if len(found) <= 1:
        return next(iter(found), namespace)
    from opbuilder.errors import BuildError

    raise BuildError(
        f"opbuilder: op {op!r} loaded from {artifact}, but it registered no op under its build's namespace "
        f"{namespace!r} and ops under several others: {', '.join(sorted(found))}. Register them with "
        "OPB_LIBRARY(m) (one namespace per build, so load() can return it), or take them from torch.ops.<namespace>."
    )


@contextlib.contextmanager
def _global_dlopen():
    import ctypes

    old = sys.getdlopenflags()
    sys.setdlopenflags(old | ctypes.RTLD_GLOBAL)
    try:
        yield
    finally:
        sys.setdlopenflags(old)
