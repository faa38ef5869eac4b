from pathlib import Path

from opbuilder.jit import registry
from opbuilder.jit.builder import OpBuilder
from opbuilder.paths import KERNELS_DIR, PREBUILT_DIR


class BuiltinBuilder(OpBuilder):
    """A built-in op: its sources live under ``kernels/``, which is also an include path."""

    def source_root(self) -> Path:
        return KERNELS_DIR

    def include_paths(self) -> list[str]:
        return ["."]

    def prebuilt_dir(self) -> Path | None:
        """Only the registry's own builders can have install-time builds; a user's op of the same name,
        or a subclass, is never served one."""
        cls = type(self)
        if registry.BUILDERS.get(self.name) != f"{cls.__module__}:{cls.__qualname__}":
            return None
        return PREBUILT_DIR / self.name
