from pathlib import Path

from opbuilder.builder import KERNELS_DIR, OpBuilder


class BuiltinBuilder(OpBuilder):
    """A built-in op: its sources live under ``kernels/``, which is also an include path."""

    def source_root(self) -> Path:
        return KERNELS_DIR

    def include_paths(self) -> list[str]:
        return ["."]
