"""``opbuilder new``: the skeleton of a user's op builds and its generated test passes as written,
on the CPU here and, with ``--cuda``, on the GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import CUDA, ROOT, requires_cuda
from opbuilder import scaffold, toolchain
from opbuilder.builder import INCLUDE_DIR

NVCC = toolchain.nvcc_path()
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]


def _env() -> dict[str, str]:
    # The user's project is elsewhere: opbuilder must come from this checkout even where it is not installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _new(directory: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "opbuilder", "new", name, "--dir", str(directory), *flags]
    return subprocess.run(argv, capture_output=True, text=True, cwd=directory, env=_env())


def _run_generated_test(directory: Path, name: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"{name}/test_{name}.py"]
    return subprocess.run(argv, capture_output=True, text=True, cwd=directory, timeout=1200, env=_env())


def test_cpu_skeleton_builds_and_its_test_passes(tmp_path: Path) -> None:
    created = _new(tmp_path, "scale_rows")
    assert created.returncode == 0, created.stderr
    assert "scale_rows/csrc/binding.cpp" in created.stdout and "python -m pytest" in created.stdout
    root = tmp_path / "scale_rows"
    assert not list(root.rglob("*.cu")) and not list(root.rglob("*.cuh"))
    for path in root.rglob("*.*"):
        text = path.read_text()
        assert "{{" not in text and "@cuda" not in text and "@end" not in text, path
    assert "OPB_WITH_CUDA" not in (root / "csrc" / "binding.cpp").read_text()

    result = _run_generated_test(tmp_path, "scale_rows")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    passed = result.stdout.count(" PASSED")
    assert passed >= 15 and " FAILED" not in result.stdout, result.stdout[-3000:]
    assert "test_gradcheck PASSED" in result.stdout and "test_torch_compile_fullgraph[cpu] PASSED" in result.stdout


def test_new_refuses_bad_names_and_existing_folders(tmp_path: Path) -> None:
    for bad in ("Relu", "1op", "my-op", "class", "torch"):
        with pytest.raises(ValueError, match="NAME"):
            scaffold.create(bad, tmp_path, cuda=False)
    scaffold.create("ok_op", tmp_path, cuda=False)
    with pytest.raises(FileExistsError, match="already exists"):
        scaffold.create("ok_op", tmp_path, cuda=True)
    assert _new(tmp_path, "ok_op").returncode == 2


@pytest.mark.skipif(NVCC is None or CUDA, reason="nvcc not installed, or a GPU is here: the GPU test below builds "
                    "and runs the same skeleton")
def test_cuda_skeleton_compiles_with_nvcc(tmp_path: Path) -> None:
    """Where there is nvcc but no GPU: the generated CUDA code compiles for sm_90 and the binding's
    CUDA part is valid C++."""
    from torch.utils.cpp_extension import include_paths

    scaffold.create("scale_rows", tmp_path, cuda=True)
    csrc = tmp_path / "scale_rows" / "csrc"
    assert "csrc/scale_rows.cu" in (tmp_path / "scale_rows" / "builder.py").read_text()
    cu = [NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", *TORCH_NVCC_DEFINES,
          f"-I{INCLUDE_DIR}", f"-I{csrc}", "-c", str(csrc / "scale_rows.cu"), "-o", str(tmp_path / "k.o")]
    result = subprocess.run(cu, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]

    stub = tmp_path / "stub" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"  # absent from CPU torch
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    binding = ["c++", toolchain.cxx_standard(), "-fsyntax-only", "-DOPB_WITH_CUDA", "-DOPB_NAMESPACE=opb_check",
               f"-I{INCLUDE_DIR}", f"-I{csrc}", f"-I{Path(toolchain.cuda_home()) / 'include'}",
               f"-I{tmp_path / 'stub'}", *[f"-I{p}" for p in include_paths()],
               f"-I{sysconfig.get_paths()['include']}", str(csrc / "binding.cpp")]
    result = subprocess.run(binding, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


@requires_cuda
def test_cuda_skeleton_builds_and_its_test_passes_on_the_gpu(tmp_path: Path) -> None:
    created = _new(tmp_path, "scale_rows_cuda", "--cuda")
    assert created.returncode == 0, created.stderr
    result = _run_generated_test(tmp_path, "scale_rows_cuda")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert " FAILED" not in result.stdout
    cuda_passed = [ln for ln in result.stdout.splitlines() if "cuda]" in ln and " PASSED" in ln]
    assert len(cuda_passed) >= 15, result.stdout[-3000:]
    assert "test_torch_compile_fullgraph[cuda] PASSED" in result.stdout
