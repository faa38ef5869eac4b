"""opbuilder: build C++/CUDA ops for PyTorch on first use, into a content-addressed cache."""

from opbuilder.builder import OpBuilder
from opbuilder.errors import BuildError, CacheError, CacheLockTimeout, IncompatibleOpError, UnknownOpError
from opbuilder.registry import get_builder
from opbuilder.warm import prepare

__version__ = "0.1.0"

__all__ = [
    "BuildError",
    "CacheError",
    "CacheLockTimeout",
    "IncompatibleOpError",
    "OpBuilder",
    "UnknownOpError",
    "get_builder",
    "prepare",
    "__version__",
]
