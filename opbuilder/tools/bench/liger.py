"""Liger-Kernel (Triton kernels for LLM training) as a peer in the benchmark, where it is installed
(``pip install 'opbuilder[liger]'``) and the device is CUDA (Triton needs a GPU).

Each adapter takes Liger's functional module (``liger_kernel.transformers.functional``) and returns a
callable on the benchmark's inputs for an op, computing what ours computes:

- ``fused_add_rmsnorm``: ``liger_fused_add_rms_norm`` -> ``(out, residual_out)``, Llama casting (the norm in
  float32, as ours), not in place: in place, its backward writes the input gradient into the output
  gradient, which the benchmark reuses for every step of an input set;
- ``fused_relu_layernorm``: ``torch.relu`` then ``liger_layer_norm`` (Liger has no fused ReLU + LayerNorm);
- ``softmax``: ``liger_softmax`` (the last dim).

Liger has no relu and no matmul + bias + ReLU: those ops get no Liger row.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from opbuilder.tools.bench.specs import LN_EPS, RMS_EPS, Fn

MODULE = "liger_kernel.transformers.functional"


def _fused_add_rmsnorm(liger: Any) -> Fn:
    def call(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual_out = liger.liger_fused_add_rms_norm(inp, residual, weight, RMS_EPS, 0.0, "llama", False)
        return out, residual_out

    return call


def _relu_layernorm(liger: Any) -> Fn:
    def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return liger.liger_layer_norm(torch.relu(x), weight, bias, LN_EPS)

    return call


def _softmax(liger: Any) -> Fn:
    def call(x: torch.Tensor) -> torch.Tensor:
        return liger.liger_softmax(x)

    return call


#: op name -> adapter (Liger's functional module -> a callable on the op's benchmark inputs)
ADAPTERS: dict[str, Callable[[Any], Fn]] = {
    "fused_add_rmsnorm": _fused_add_rmsnorm,
    "fused_relu_layernorm": _relu_layernorm,
    "softmax": _softmax,
}


def load(device: torch.device) -> tuple[ModuleType | None, str]:
    """(Liger's functional module, its version) or (None, why there is no Liger row). Importing Liger pulls
    in Triton; nothing is imported when the device is not CUDA."""
    if device.type != "cuda":
        return None, "Liger-Kernel runs on CUDA only (Triton)"
    try:
        module = importlib.import_module(MODULE)
    except ImportError as e:
        return None, f"not installed (pip install 'opbuilder[liger]'): {e}"
    except Exception as e:  # a broken install must not stop the benchmark
        return None, f"import failed: {type(e).__name__}: {str(e).strip()[:200]}"
    try:
        from importlib.metadata import version

        return module, version("liger-kernel")
    except Exception:  # metadata missing (a source tree on sys.path): the module still works
        return module, "unknown version"


def adapter(op: str, liger: ModuleType | Any | None) -> Fn | None:
    """Liger's callable for ``op``, or None where Liger has no such op or is not loaded."""
    make = ADAPTERS.get(op)
    return None if liger is None or make is None else make(liger)
