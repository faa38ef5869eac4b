"""What the kernel tuning scripts beside this file share (tune_fwd.py, quick_layernorm.py, quick_rmsnorm.py):
the nvcc flags the op builder compiles CUDA with, and opbuilder's own timer. They build variant kernels into a
plain shared library (no torch headers) and call it through ctypes."""

from __future__ import annotations

from opbuilder.dispatch import timing  # noqa: F401  (re-exported: the same timer as `opbuilder bench`)

NVCC_FLAGS = [  # as the op builder compiles (opbuilder/jit/builder.py, torch's cpp_extension defines)
    "-O3", "-std=c++20", "--expt-relaxed-constexpr", "-gencode=arch=compute_90,code=sm_90",
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Ikernels",
    "-Iopbuilder/include", "-Xptxas", "-v",
]
