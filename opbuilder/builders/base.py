from pathlib import Path

from opbuilder.builder import KERNELS_DIR, OpBuilder

# TEMP: the stable-ABI flags the builder will pass itself once it detects a stable-ABI op from its sources.
_STABLE_FLAGS = ["-DOPB_STABLE_ABI", "-DTORCH_TARGET_VERSION=0x020a000000000000"]


class BuiltinBuilder(OpBuilder):
    """A built-in op: its sources live under ``kernels/``, which is also an include path."""

    def source_root(self) -> Path:
        return KERNELS_DIR

    def include_paths(self) -> list[str]:
        return ["."]

    def cxx_args(self) -> list[str]:
        return super().cxx_args() + _STABLE_FLAGS

    def nvcc_args(self) -> list[str]:
        return super().nvcc_args() + _STABLE_FLAGS
