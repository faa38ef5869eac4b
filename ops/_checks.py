"""Input checks shared by the op wrappers: each error names the op, the argument, what was expected
and what was got."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(op: str, arg: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float(op: str, arg: str, value: object) -> torch.Tensor:
    tensor = check_tensor(op, arg, value)
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {arg} must be float32, float16, bfloat16 or float64, got {tensor.dtype}")
    return tensor


def check_same(op: str, ref_arg: str, ref: torch.Tensor, arg: str, other: torch.Tensor) -> None:
    """``other`` must have ``ref``'s dtype and device."""
    if other.dtype is not ref.dtype:  # dtypes are singletons
        raise TypeError(f"{op}: {arg} must have {ref_arg}'s dtype {ref.dtype}, got {other.dtype}")
    if other.device != ref.device:
        raise ValueError(f"{op}: {arg} must be on {ref_arg}'s device {ref.device}, got {other.device}")
