"""The old place of ``LazyOps``, which projects written by an earlier ``opbuilder new`` import; it lives in
``opbuilder.torchop.lazy``."""

from opbuilder.torchop.lazy import LazyOps

__all__ = ["LazyOps"]
