"""Comparing an op against a float64 reference, with a tolerance per dtype."""

from __future__ import annotations

import torch

from opbuilder.dispatch.definitions import TOLERANCES  # (rtol, atol) per input dtype; check uses the same table

__all__ = ["TOLERANCES", "assert_close_to_ref"]


def assert_close_to_ref(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """``actual`` (any dtype) against a float64 reference, with ``dtype``'s tolerance; ``scale``
    widens the tolerance for ops whose error grows with the reduction length."""
    rtol, atol = TOLERANCES[dtype]
    assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected64.shape, f"shape {tuple(actual.shape)}, expected {tuple(expected64.shape)}"
    torch.testing.assert_close(
        actual.double().cpu(), expected64.double().cpu(), rtol=rtol * scale, atol=atol * scale, equal_nan=True
    )
