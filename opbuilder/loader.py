"""Loading a built artifact into this process: a dlopen, nothing else."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_LOADED: dict[tuple[str, str], Any] = {}


def loaded(op: str, key: str) -> Any | None:
    return _LOADED.get((op, key))


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
