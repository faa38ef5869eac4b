"""opbuilder: build C++/CUDA ops for PyTorch on first use, into a content-addressed cache."""

from pathlib import Path as _Path

# In a source checkout ops/ lies beside this folder: map it to opbuilder.ops as an install does (two stats).
if not (_Path(__file__).parent / "ops").is_dir() and (_Path(__file__).parent.parent / "ops" / "__init__.py").is_file():
    from opbuilder import _checkout

    _checkout.install()

from opbuilder.builder import OpBuilder
from opbuilder.dispatch import apply
from opbuilder.errors import BuildError, CacheError, CacheLockTimeout, IncompatibleOpError, UnknownOpError
from opbuilder.registry import get_builder

__version__ = "0.1.0"


__all__ = [
    "BuildError",
    "CacheError",
    "CacheLockTimeout",
    "IncompatibleOpError",
    "OpBuilder",
    "UnknownOpError",
    "apply",
    "get_builder",
    "prepare",
    "__version__",
]


def __getattr__(name: str):  # prepare() pulls in the build machinery: imported when first used
    if name == "prepare":
        from opbuilder.warm import prepare

        return prepare
    raise AttributeError(f"module 'opbuilder' has no attribute {name!r}")
