"""Every CUDA source compiles for sm_90, and every binding compiles with its CUDA part, where nvcc
is installed, even on a machine without a GPU: a CUDA syntax error cannot land."""

from __future__ import annotations

import re
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from opbuilder.jit import registry, toolchain
from opbuilder.paths import INCLUDE_DIR, KERNELS_DIR

NVCC = toolchain.nvcc_path()
# With a GPU, the CUDA tests build every op for it (torch's own nvcc command, these files, the GPU's arch):
# compiling the same files again here would only add minutes of nvcc to that suite.
needs_nvcc = pytest.mark.skipif(NVCC is None or torch.cuda.is_available(),
                                reason="nvcc not installed, or a GPU is here and the CUDA tests build these sources")

# What torch.utils.cpp_extension passes to nvcc, so these compiles see what real builds see.
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]

CU_FILES = sorted(KERNELS_DIR.glob("*/*.cu"))
BINDINGS = sorted(p for p in KERNELS_DIR.glob("*/binding.cpp") if any(p.parent.glob("*.cu")))

# A per-dtype file: one macro line instantiating a shared header's kernels for one type, so that a real build
# compiles the types in parallel (softmax_forward_bf16.cu, fused_relu_layernorm_f32_backward.cu, ...).
_PER_DTYPE = re.compile(r"(?P<stem>.+)_(?:bf16|f16|f32|f64)(?P<tail>_backward)?\.cu")


def _units(files: list[Path]) -> list[tuple[Path, ...]]:
    """The files each nvcc run compiles: a file alone, except per-dtype files of one header, which compile
    together as one translation unit (each alone parsed the same headers again: 14.5 s of CPU for softmax's
    four forward files on the 2-core machine, 8.2 s together; every type's kernels are still compiled)."""
    groups: dict[tuple[Path, str], list[Path]] = {}
    for f in files:
        m = _PER_DTYPE.fullmatch(f.name)
        key = (f.parent, f"{m['stem']}_*{m['tail'] or ''}.cu") if m else (f.parent, f.name)
        groups.setdefault(key, []).append(f)
    return [tuple(group) for group in groups.values()]


def _unit_id(unit: tuple[Path, ...]) -> str:
    names = [f.name for f in unit]
    return f"{unit[0].parent.name}/{names[0] if len(names) == 1 else '+'.join(names)}"


def test_per_dtype_files_are_grouped_by_their_header() -> None:
    units = {_unit_id(u): u for u in _units(CU_FILES)}
    assert sum(len(u) for u in units.values()) == len(CU_FILES)
    for unit in units.values():
        if len(unit) > 1:  # each member is only includes and one instantiation line
            for f in unit:
                lines = [ln for ln in f.read_text().splitlines() if ln.strip() and not ln.startswith("//")]
                assert all(ln.startswith("#include") for ln in lines[:-1]) and len(lines) <= 3, (f, lines)


@needs_nvcc
@pytest.mark.parametrize("unit", _units(CU_FILES), ids=_unit_id)
def test_cu_compiles_for_sm90(unit: tuple[Path, ...], tmp_path: Path) -> None:
    source = unit[0]
    if len(unit) > 1:
        source = tmp_path / "unit.cu"
        source.write_text("".join(f'#include "{f}"\n' for f in unit))
    builder = registry.get_builder(unit[0].parent.name)
    missing = [n for n in builder.CUDA_LIBRARIES if toolchain.find_cuda_library(n) is None]
    if missing:
        pytest.skip(f"headers of {', '.join(missing)} are not installed here")
    libs = [f"-I{toolchain.find_cuda_library(n).include_dir}" for n in builder.CUDA_LIBRARIES]
    cmd = [NVCC, toolchain.cxx_standard(), "-O3", "-gencode=arch=compute_90,code=sm_90", "--expt-relaxed-constexpr",
           *TORCH_NVCC_DEFINES, f"-I{INCLUDE_DIR}", f"-I{KERNELS_DIR}", *libs, "-c", str(source), "-o", str(tmp_path / "k.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


@needs_nvcc
@pytest.mark.parametrize("source", BINDINGS, ids=lambda p: p.parent.name)
def test_binding_compiles_with_cuda(source: Path, tmp_path: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    # A CPU build of torch ships c10/cuda headers but not the one its CMake generates; an empty
    # stand-in is enough for a syntax check.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    cuda_include = Path(toolchain.cuda_home()) / "include"
    cmd = ["c++", toolchain.cxx_standard(), "-fsyntax-only", "-DOPB_WITH_CUDA", "-DOPB_NAMESPACE=opb_check",
           f"-I{INCLUDE_DIR}", f"-I{KERNELS_DIR}", f"-I{cuda_include}", f"-I{tmp_path}",
           *[f"-I{p}" for p in include_paths()], f"-I{sysconfig.get_paths()['include']}", str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
