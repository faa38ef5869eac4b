"""What the kernel tuning scripts beside this file share (tune_fwd.py, quick_layernorm.py, quick_rmsnorm.py,
peer_cases.py): the nvcc flags the op builder compiles CUDA with, and opbuilder's own timer. They build variant
kernels into a plain shared library (no torch headers) and call it through ctypes."""

from __future__ import annotations

from opbuilder.dispatch import timing  # noqa: F401  (re-exported: the same timer as `opbuilder bench`)
from opbuilder.jit.registry import get_builder


def nvcc_flags(op: str = "softmax") -> list[str]:
    """The flags the op builder compiles ``op``'s CUDA files with (its C++ standard: C++17 for a stable-ABI
    op, the archs of the visible GPUs or TORCH_CUDA_ARCH_LIST, torch's half/bfloat16 defines), then what a
    plain ctypes library of the kernels needs. Include paths relative to the checkout's root (the cwd)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    builder = get_builder(op)
    return [*builder.final_nvcc_args(), *COMMON_NVCC_FLAGS, "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden",
            "-Ikernels", "-Iopbuilder/include", "-Xptxas", "-v"]


NVCC_FLAGS = nvcc_flags()
