"""``opbuilder new``: the skeleton of a user's op builds and its generated test passes as written,
on the CPU here and, with ``--cuda``, on the GPU machine. The default skeleton is on the LibTorch stable
ABI; ``--abi classic`` writes the ``torch/library.h`` + ATen kind."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from helpers import CUDA, ROOT, requires_cuda
from opbuilder.jit import toolchain
from opbuilder.tools import scaffold
from opbuilder.jit.builder import OpBuilder
from opbuilder.paths import INCLUDE_DIR

NVCC = toolchain.nvcc_path()
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]
STABLE_FLAGS = ["-DOPB_STABLE_ABI", "-DTORCH_TARGET_VERSION=0x020a000000000000"]
# What a stable binding may include from torch, and what only a classic one does.
CLASSIC_HEADERS = ("torch/library.h", "ATen/", "c10/", "torch/extension.h", "opbuilder/binding.h")


def _env(**extra: str) -> dict[str, str]:
    # The user's project is elsewhere: opbuilder must come from this checkout even where it is not installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _new(directory: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "opbuilder", "new", name, "--dir", str(directory), *flags]
    return subprocess.run(argv, capture_output=True, text=True, cwd=directory, env=_env())


def _run_generated_test(directory: Path, name: str, **env: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"{name}/test_{name}.py"]
    return subprocess.run(argv, capture_output=True, text=True, cwd=directory, timeout=1200, env=_env(**env))


def _generated_builder(root: Path) -> OpBuilder:
    """The generated op's builder, imported from its file as the user's project would."""
    spec = importlib.util.spec_from_file_location(f"_gen_{root.name}_builder", root / "builder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = next(v for k, v in vars(module).items() if k.endswith("Builder") and v is not OpBuilder)
    return cls()


def _syntax_check(files: list[Path], flags: list[str]) -> None:
    """``c++ -fsyntax-only`` on each file, all at once (the parse of torch's headers is the cost)."""
    from torch.utils.cpp_extension import include_paths

    base = ["c++", "-fsyntax-only", "-DOPB_NAMESPACE=opb_check", *flags, *[f"-I{p}" for p in include_paths()],
            f"-I{sysconfig.get_paths()['include']}"]
    procs = [(f, subprocess.Popen([*base, str(f)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for f in files]
    for f, proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{f}:\n{out[-4000:]}"


def _torch_includes(path: Path) -> list[str]:
    return [ln.split()[1].strip("<>\"") for ln in path.read_text().splitlines() if ln.startswith("#include")]


def test_stable_cpu_skeleton_builds_and_its_test_passes(tmp_path: Path) -> None:
    created = _new(tmp_path, "scale_rows")
    assert created.returncode == 0, created.stderr
    assert "scale_rows/csrc/binding.cpp" in created.stdout and "python -m pytest" in created.stdout
    assert "stable ABI" in created.stdout
    root = tmp_path / "scale_rows"
    assert not list(root.rglob("*.cu")) and not list(root.rglob("*.cuh"))
    for path in root.rglob("*.*"):
        text = path.read_text()
        assert "{{" not in text and "//@" not in text and "#@" not in text, path
    binding = (root / "csrc" / "binding.cpp").read_text()
    assert "OPB_WITH_CUDA" not in binding
    assert "#include <opbuilder/stable.h>" in binding and "TORCH_BOX(&scale_rows_cpu)" in binding
    for source in (root / "csrc").iterdir():
        classic = [h for h in _torch_includes(source) if h.startswith(CLASSIC_HEADERS)]
        assert not classic, f"{source.name} includes {classic}"
    assert STABLE_FLAGS == [a for a in _generated_builder(root).final_cxx_args() if a in STABLE_FLAGS]

    cache = tmp_path / "cache"
    result = _run_generated_test(tmp_path, "scale_rows", OPB_CACHE_DIR=str(cache))
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    passed = result.stdout.count(" PASSED")
    assert passed >= 15 and " FAILED" not in result.stdout, result.stdout[-3000:]
    assert "test_gradcheck PASSED" in result.stdout and "test_torch_compile_fullgraph[cpu] PASSED" in result.stdout

    # On the stable ABI the library needs nothing of ATen or c10: only torch's C shim (and libc/libstdc++).
    (library,) = cache.glob("scale_rows/*/scale_rows_*.so")
    nm = subprocess.run(["nm", "-D", "-C", "--undefined-only", str(library)], capture_output=True, text=True)
    assert nm.returncode == 0, nm.stderr
    symbols = [ln.split()[-1] for ln in nm.stdout.splitlines() if ln.strip()]
    assert any(s.startswith(("aoti_torch_", "torch_")) for s in symbols), symbols
    assert not [s for s in symbols if s.startswith(("at::", "c10::", "torch::"))], nm.stdout


def _cuda_stub(tmp_path: Path) -> Path:
    """The one c10/cuda header a CPU build of torch lacks, so the classic CUDA binding parses here."""
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    return tmp_path / "stub"


def test_classic_skeleton_compiles(tmp_path: Path) -> None:
    """``--abi classic``: torch/library.h and ATen, no stable flags. Its generated test passes as the stable
    one's does (run by hand: its build takes ~3 s more here); in the suite its binding, with the CUDA part,
    and its CPU kernel are parsed, both at once."""
    created = _new(tmp_path, "scale_rows_classic", "--abi", "classic", "--cuda")
    assert created.returncode == 0, created.stderr
    assert "classic ABI" in created.stdout
    root = tmp_path / "scale_rows_classic"
    csrc = root / "csrc"
    binding = (csrc / "binding.cpp").read_text()
    assert "#include <opbuilder/binding.h>" in binding and "&scale_rows_classic_cpu);" in binding
    assert "TORCH_BOX" not in binding and "stable" not in (csrc / "scale_rows_classic_cpu.cpp").read_text()
    flags = _generated_builder(root).final_cxx_args()
    assert not [a for a in flags if a in STABLE_FLAGS], flags
    includes = [f"-I{INCLUDE_DIR}", f"-I{csrc}", f"-I{Path(toolchain.cuda_home()) / 'include'}",
                f"-I{_cuda_stub(tmp_path)}"] if NVCC else [f"-I{INCLUDE_DIR}", f"-I{csrc}"]
    _syntax_check([csrc / "binding.cpp", csrc / "scale_rows_classic_cpu.cpp"],
                  [*flags, *includes, *(["-DOPB_WITH_CUDA"] if NVCC else [])])


def test_new_refuses_bad_names_abis_and_existing_folders(tmp_path: Path) -> None:
    for bad in ("Relu", "1op", "my-op", "class", "torch"):
        with pytest.raises(ValueError, match="NAME"):
            scaffold.create(bad, tmp_path, cuda=False)
    with pytest.raises(ValueError, match="--abi must be one of stable, classic, got 'stabel'"):
        scaffold.create("ok_op", tmp_path, cuda=False, abi="stabel")
    assert not (tmp_path / "ok_op").exists()
    scaffold.create("ok_op", tmp_path, cuda=False)
    with pytest.raises(FileExistsError, match="already exists"):
        scaffold.create("ok_op", tmp_path, cuda=True)
    assert _new(tmp_path, "ok_op").returncode == 2
    assert _new(tmp_path, "other_op", "--abi", "pybind").returncode == 2


def test_new_into_a_folder_it_cannot_write_names_it_and_leaves_nothing(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    from opbuilder.tools import cli

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert cli.main(["new", "ok_op", "--dir", str(a_file)]) == 1
    err = capsys.readouterr().err
    assert f"cannot make {a_file / 'ok_op'} (--dir {a_file})" in err and "Traceback" not in err

    real, calls = Path.write_text, []

    def full_disk(self: Path, *args: object, **kwargs: object) -> int:
        calls.append(self)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert cli.main(["new", "ok_op", "--dir", str(tmp_path)]) == 1
    assert "No space left on device; nothing was left there" in capsys.readouterr().err
    assert not (tmp_path / "ok_op").exists()


def test_render_keeps_the_sections_of_the_abi_and_cuda_asked_for() -> None:
    text = "a\n//@stable\nb\n//@cuda\nc\n//@end\n//@end\n//@classic\nd\n//@end\n#@cuda\ne\n#@end\nf {{name}}\n"
    assert scaffold.render(text, "op", cuda=False, abi="stable") == "a\nb\nf op\n"
    assert scaffold.render(text, "op", cuda=True, abi="stable") == "a\nb\nc\ne\nf op\n"
    assert scaffold.render(text, "op", cuda=True, abi="classic") == "a\nd\ne\nf op\n"
    with pytest.raises(ValueError, match="never closed"):
        scaffold.render("//@cuda\nx\n", "op", cuda=True)
    with pytest.raises(ValueError, match="@end without"):
        scaffold.render("x\n//@end\n", "op", cuda=True)
    stable = {str(rel) for _, rel in scaffold.plan("op", cuda=True, abi="stable")}
    classic = {str(rel) for _, rel in scaffold.plan("op", cuda=True, abi="classic")}
    assert stable == classic and "csrc/binding.cpp" in stable and "csrc/op.cu" in stable


@pytest.mark.skipif(NVCC is None or CUDA, reason="nvcc not installed, or a GPU is here: the GPU test below builds "
                    "and runs the same skeleton")
def test_cuda_skeleton_compiles_with_nvcc(tmp_path: Path) -> None:
    """Where there is nvcc but no GPU (the CPU torch does not build .cu files): the generated CUDA code
    compiles for sm_90 and the stable binding's CUDA part is valid C++ (the classic one: see above)."""
    scaffold.create("scale_rows", tmp_path, cuda=True)
    csrc = tmp_path / "scale_rows" / "csrc"
    assert "csrc/scale_rows.cu" in (tmp_path / "scale_rows" / "builder.py").read_text()
    cu = [NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", *TORCH_NVCC_DEFINES,
          f"-I{INCLUDE_DIR}", f"-I{csrc}", "-c", str(csrc / "scale_rows.cu"), "-o", str(tmp_path / "k.o")]
    nvcc = subprocess.Popen(cu, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    flags = [toolchain.cxx_standard(), "-DOPB_WITH_CUDA", *STABLE_FLAGS, f"-I{INCLUDE_DIR}", f"-I{csrc}",
             f"-I{Path(toolchain.cuda_home()) / 'include'}"]
    _syntax_check([csrc / "binding.cpp"], flags)
    out, _ = nvcc.communicate(timeout=600)
    assert nvcc.returncode == 0, out[-4000:]


@requires_cuda
@pytest.mark.parametrize("abi", ["stable", "classic"])
def test_cuda_skeleton_builds_and_its_test_passes_on_the_gpu(tmp_path: Path, abi: str) -> None:
    name = f"scale_rows_{abi}_cuda"
    created = _new(tmp_path, name, "--cuda", "--abi", abi)
    assert created.returncode == 0, created.stderr
    result = _run_generated_test(tmp_path, name)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert " FAILED" not in result.stdout
    cuda_passed = [ln for ln in result.stdout.splitlines() if "cuda]" in ln and " PASSED" in ln]
    assert len(cuda_passed) >= 15, result.stdout[-3000:]
    assert "test_torch_compile_fullgraph[cuda] PASSED" in result.stdout
