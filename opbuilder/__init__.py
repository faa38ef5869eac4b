"""opbuilder: build C++/CUDA ops for PyTorch on first use, into a content-addressed cache.

The package is laid out in wings (the README's Layout section): ``jit/`` builds and loads, ``dispatch/``
chooses among an op's implementations, ``torchop/`` registers the ops with torch, ``tools/`` holds the
commands; ``env``, ``errors`` and ``paths`` are the ground they stand on.
"""

import importlib as _importlib
from pathlib import Path as _Path

# In a source checkout ops/ lies beside this folder: map it to opbuilder.ops as an install does (two stats).
if not (_Path(__file__).parent / "ops").is_dir() and (_Path(__file__).parent.parent / "ops" / "__init__.py").is_file():
    from opbuilder import _checkout

    _checkout.install()

from opbuilder.errors import BuildError, CacheError, CacheLockTimeout, IncompatibleOpError, UnknownOpError
from opbuilder.jit.builder import OpBuilder
from opbuilder.jit.registry import get_builder

__version__ = "0.1.0"

#: What ``from opbuilder import NAME`` also gives, imported at first use (the dispatcher, the build
#: machinery and torch stay unimported until then): name -> (module, attribute or None for the module).
_LAZY: dict[str, tuple[str, str | None]] = {
    "prepare": ("opbuilder.jit.warm", "prepare"),
    "apply": ("opbuilder.dispatch.router", "apply"),
    "definitions": ("opbuilder.dispatch.definitions", None),
    "implementations": ("opbuilder.dispatch.implementations", None),
    "sharding": ("opbuilder.torchop.sharding", None),
    "LazyOps": ("opbuilder.torchop.lazy", "LazyOps"),
}

__all__ = [
    "BuildError",
    "CacheError",
    "CacheLockTimeout",
    "IncompatibleOpError",
    "LazyOps",
    "OpBuilder",
    "UnknownOpError",
    "apply",
    "definitions",
    "get_builder",
    "implementations",
    "prepare",
    "sharding",
    "__version__",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'opbuilder' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    found = _importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)
