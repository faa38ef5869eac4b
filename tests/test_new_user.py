"""What a new user meets on a fresh machine: today's torch, an nvcc on PATH that is a wrapper outside the
CUDA toolkit, third-party ops written as their projects write them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import run_python
from opbuilder import toolchain


@pytest.mark.skipif(toolchain.nvcc_path() is None, reason="needs a CUDA toolkit (nvcc)")
def test_cpp_extension_is_imported_quietly_and_uses_the_toolkit_opbuilder_keys(tmp_path: Path) -> None:
    # nvcc on PATH as a wrapper script outside the toolkit (as /usr/local/bin/nvcc on the CI image): torch's
    # cpp_extension then guesses the wrapper's grandparent as CUDA_HOME and, with a CUDA torch and no GPU,
    # logs "No CUDA runtime is found" on stderr at import.
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec {toolchain.nvcc_path()} \"$@\"\n")
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = f"{wrapper.parent}{os.pathsep}{env.get('PATH', '')}"
    code = ("import os, torch\n"
            "from opbuilder import toolchain\n"
            "cpp = toolchain.cpp_extension(cuda=True)\n"
            "print('HOMES', os.path.realpath(cpp.CUDA_HOME), os.path.realpath(toolchain.cuda_home()))\n")
    result = run_python(code, env={"CUDA_HOME": "", "CUDA_PATH": "", "PATH": env["PATH"]})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "No CUDA runtime" not in result.stderr and "cpp_extension" not in result.stderr, result.stderr
    homes = next(line for line in result.stdout.splitlines() if line.startswith("HOMES")).split()[1:]
    assert homes[0] == homes[1], homes
    assert shutil.which("nvcc", path=str(wrapper.parent)) == str(wrapper)
