"""Loading a built artifact into this process: a dlopen, nothing else."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from opbuilder import cache

_LOADED: dict[tuple[str, str], Any] = {}


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


def load_artifact(op: str, key: str, artifact: Path, manifest: dict) -> Any:
    """Load a library registering Torch ops (returns its ``torch.ops`` namespace) or a Python
    extension module (returns the module). Raises OSError or ImportError when the file is bad."""
    if manifest.get("python_module"):
        name = manifest["module_name"]
        spec = importlib.util.spec_from_file_location(name, artifact)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {artifact} as module {name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        handle: Any = module
    else:
        import torch

        torch.ops.load_library(str(artifact))
        handle = getattr(torch.ops, manifest["namespace"])
    _LOADED[(op, key)] = handle
    return handle
