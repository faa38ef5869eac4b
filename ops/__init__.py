"""The ops models use: functions and ``nn.Module`` layers. Importing builds nothing; a first call does.

Each name is imported from its op's module at first use (PEP 562), so ``ops.relu(x)`` imports
``opbuilder.ops.relu`` alone; ``from opbuilder.ops import X`` and ``dir()`` work as for any module.
"""

from __future__ import annotations

import importlib as _importlib
import sys as _sys
import types as _types

#: Public name -> the op module that defines it.
_WHERE: dict[str, str] = {
    "FusedAddRMSNorm": "fused_add_rmsnorm",
    "RMSNorm": "fused_add_rmsnorm",
    "fused_add_rmsnorm": "fused_add_rmsnorm",
    "rms_norm": "fused_add_rmsnorm",
    "FusedLinearReLU": "fused_matmul_add_relu",
    "fused_matmul_add_relu": "fused_matmul_add_relu",
    "FusedReLULayerNorm": "fused_relu_layernorm",
    "fused_relu_layernorm": "fused_relu_layernorm",
    "ReLU": "relu",
    "relu": "relu",
    "Softmax": "softmax",
    "softmax": "softmax",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _importlib.import_module(f"{__name__}.{_WHERE[name]}")  # binds its public names (_Package.__setattr__)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


class _Package(_types.ModuleType):
    """Importing ``opbuilder.ops.relu`` (by anyone) sets the package's attribute ``relu`` to the module; the
    package's ``relu`` is the function, as before: an op module's arrival binds its public names instead."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, _types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            for public, module in _WHERE.items():
                if module == name:
                    super().__setattr__(public, getattr(value, public))
            if name in _WHERE:
                return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
