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


# ---- a user's own op, written in a temporary project --------------------------------------------------

BUILDER = '''
from opbuilder import OpBuilder


class Builder(OpBuilder):
    NAME = {name!r}
    ABI = {abi!r}

    def sources(self):
        return {sources!r}

    def cxx_args(self):
        return super().cxx_args() + {cxx!r}
'''


def user_builder(project: Path, name: str, files: dict[str, str], cxx: list[str] | None = None,
                 sources: list[str] | None = None, abi: str | None = None, module: str | None = None):
    """A builder object of the op ``name`` whose files (``files``: path under ``project`` -> text) are
    written under ``project``, its builder module beside them (``sources``: default, the .cpp/.cu files)."""
    import importlib.util
    import sys

    for rel, text in files.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    sources = sources if sources is not None else [f for f in files if f.endswith((".cpp", ".cu"))]
    module = module or f"{name}_builder"
    path = project / f"{module}.py"
    path.write_text(BUILDER.format(name=name, abi=abi, sources=sources, cxx=cxx or []))
    spec = importlib.util.spec_from_file_location(f"{module}_{abs(hash(str(project)))}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.Builder()


TAGGED = '''
#include <opbuilder/stable.h>

using opb::Tensor;

Tensor twice(const Tensor& x) {
  Tensor xc = torch::stable::contiguous(x);
  Tensor y = opb::new_output(xc);
  const float* in = static_cast<const float*>(xc.data_ptr());
  float* out = static_cast<float*>(y.data_ptr());
  for (int64_t i = 0; i < xc.numel(); ++i) out[i] = 2 * in[i];
  return y;
}

// def(schema, tags): the stable API of torch 2.12 (as PyTorch's own libtorch_agn_2_12 test extension uses it)
OPB_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor", {torch::headeronly::Tag::pointwise}); }
OPB_LIBRARY_IMPL(CPU, m) { m.impl("twice", TORCH_BOX(&twice)); }
'''


@pytest.mark.skipif(toolchain.torch_version() < (2, 12), reason="the 2.12 stable API needs torch >= 2.12")
def test_a_users_torch_target_version_wins_and_keys_the_build(tmp_path: Path) -> None:
    import torch

    flag = "-DTORCH_TARGET_VERSION=0x020c000000000000"
    builder = user_builder(tmp_path, "tagged_twice", {"csrc/tagged.cpp": TAGGED}, cxx=[flag])
    assert builder.abi() == "stable" and builder.stable_target() == (2, 12)
    cxx = builder.final_cxx_args()
    assert [a for a in cxx if a.startswith("-DTORCH_TARGET_VERSION")] == [flag], cxx
    assert builder.key_inputs()["abi"] == "stable-2.12"
    op = builder.load().twice
    x = torch.randn(5)
    torch.testing.assert_close(op(x), x * 2, rtol=0, atol=0)
    assert torch.Tag.pointwise in op.default.tags
    # The same op without the flag targets 2.10 (and then lacks def(schema, tags)): another key.
    plain = user_builder(tmp_path / "plain", "tagged_twice", {"csrc/tagged.cpp": TAGGED})
    assert plain.key_inputs()["abi"] == "stable-2.10" and plain.key != builder.key


def test_a_target_above_the_installed_torch_is_a_clear_error(tmp_path: Path) -> None:
    from opbuilder.errors import IncompatibleOpError

    major, minor = toolchain.torch_version()
    later = toolchain.target_version_flag((major, minor + 1))
    builder = user_builder(tmp_path, "tagged_twice", {"csrc/tagged.cpp": TAGGED}, cxx=[later])
    with pytest.raises(IncompatibleOpError, match=rf"stable API of torch {major}\.{minor + 1} .* is installed"):
        builder.load()
    assert not builder.is_compatible()
    bad = user_builder(tmp_path / "bad", "tagged_twice", {"csrc/tagged.cpp": TAGGED},
                       cxx=["-DTORCH_TARGET_VERSION=2.12"])
    with pytest.raises(ValueError, match=r"TORCH_TARGET_VERSION: expected .*0x020c000000000000.* got '2.12'"):
        bad.key  # noqa: B018
    named = user_builder(tmp_path / "named", "tagged_twice", {"csrc/tagged.cpp": TAGGED},
                         cxx=["-DTORCH_TARGET_VERSION=TORCH_VERSION_2_11_0"])
    assert named.stable_target() == (2, 11)


# ---- bindings written as third-party projects write them -----------------------------------------------

# Our own small version of the pattern of Hugging Face kernel-builder's generated registration.h (as in
# kernels-community's activation): one branch includes the stable headers, the other torch/library.h, and the
# library registers under TORCH_EXTENSION_NAME (the op's name), not under opbuilder's keyed namespace.
REGISTRATION = '''
#pragma once
#if defined(MY_STABLE_BUILD)
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#define MY_LIBRARY_EXPAND(NAME, m) STABLE_TORCH_LIBRARY(NAME, m)
#define MY_LIBRARY_IMPL_EXPAND(NAME, k, m) STABLE_TORCH_LIBRARY_IMPL(NAME, k, m)
#else
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#define MY_LIBRARY_EXPAND(NAME, m) TORCH_LIBRARY(NAME, m)
#define MY_LIBRARY_IMPL_EXPAND(NAME, k, m) TORCH_LIBRARY_IMPL(NAME, k, m)
#endif
'''

BRANCHED = '''
#include "registration.h"

#if defined(MY_STABLE_BUILD)
using torch::stable::Tensor;
Tensor triple(const Tensor& x) {
  Tensor xc = torch::stable::contiguous(x);
  Tensor y = torch::stable::empty_like(xc);
  const float* in = static_cast<const float*>(xc.data_ptr());
  float* out = static_cast<float*>(y.data_ptr());
  for (int64_t i = 0; i < xc.numel(); ++i) out[i] = 3 * in[i];
  return y;
}
#define MY_FN TORCH_BOX(&triple)
#else
at::Tensor triple(const at::Tensor& x) { return x * 3; }
#define MY_FN &triple
#endif

MY_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, m) { m.def("triple(Tensor x) -> Tensor"); }
MY_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CPU, m) { m.impl("triple", MY_FN); }
'''


def test_the_abi_follows_the_branch_the_preprocessor_takes_and_load_returns_the_ops_namespace(tmp_path: Path) -> None:
    import torch

    files = {"csrc/registration.h": REGISTRATION, "csrc/binding.cpp": BRANCHED}
    name = "kb_triple"
    stable = user_builder(tmp_path / "stable", name, files, cxx=["-DMY_STABLE_BUILD"])
    assert stable.abi() == "stable" and stable.key_inputs()["abi"] == "stable-2.10"
    classic = user_builder(tmp_path / "classic", name, files)
    assert classic.abi() == "classic" and classic.key_inputs()["abi"] == "classic"
    # Built on the stable headers, registered under TORCH_EXTENSION_NAME: load() returns that namespace.
    ops = stable.load()
    assert ops is getattr(torch.ops, name), ops
    x = torch.randn(6)
    torch.testing.assert_close(ops.triple(x), x * 3, rtol=0, atol=0)


def test_load_returns_the_ops_of_a_library_registered_under_a_literal_namespace(tmp_path: Path) -> None:
    import torch

    # An older opbuilder's documented form: OPB_NAMESPACE is no longer defined, so the library registers under
    # the literal name "OPB_NAMESPACE".
    source = TAGGED.split("// def(schema, tags)")[0] + (
        'STABLE_TORCH_LIBRARY(OPB_NAMESPACE, m) { m.def("clampy(Tensor x) -> Tensor"); }\n'
        'STABLE_TORCH_LIBRARY_IMPL(OPB_NAMESPACE, CPU, m) { m.impl("clampy", TORCH_BOX(&twice)); }\n')
    ops = user_builder(tmp_path, "clampy", {"csrc/clampy.cpp": source}).load()
    assert ops is torch.ops.OPB_NAMESPACE
    x = torch.randn(4)
    torch.testing.assert_close(ops.clampy(x), x * 2, rtol=0, atol=0)


# ---- smaller things a new user sees ---------------------------------------------------------------------

USER_SCRIPT = '''
import warnings
import torch
import opbuilder.ops as ops
from opbuilder.errors import FallbackWarning

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ops.relu(torch.randn(4))  # the user's line
found = [w for w in caught if issubclass(w.category, FallbackWarning)]
print("WARNED", len(found), found[0].filename, found[0].lineno)
'''


def test_fallback_warning_points_at_the_users_call(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    empty = tmp_path / "bin"
    empty.mkdir()
    result = run_python(f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))",
                        env={"PATH": str(empty), "CXX": "", "OPB_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("WARNED"))
    _, count, filename, lineno = line.split()
    user_line = USER_SCRIPT.splitlines().index("    ops.relu(torch.randn(4))  # the user's line") + 1
    assert (count, filename, int(lineno)) == ("1", str(script), user_line), line


def test_a_refused_cache_gets_nothing_written_into_it(tmp_path: Path) -> None:
    import stat

    from userop import load_snippet, write_user_op

    root = tmp_path / "open-cache"
    root.mkdir()
    root.chmod(0o777)  # writable by others, not sticky: refused
    op = write_user_op(tmp_path / "proj")
    result = run_python(load_snippet(op), env={"OPB_CACHE_DIR": str(root)})
    assert result.returncode != 0 and "CacheError" in result.stderr, result.stderr[-2000:]
    assert f"refusing to use {root}" in result.stderr, result.stderr[-2000:]
    assert sorted(p.name for p in root.iterdir()) == [], "a refused cache was written into"
    assert stat.S_IMODE(root.stat().st_mode) == 0o777


PYBIND_SOURCE = '''
#include <pybind11/pybind11.h>

int add_one(int x) { return x + 1; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add_one", &add_one); }
'''


def test_a_python_modules_repr_names_its_file_in_the_cache(tmp_path: Path) -> None:
    builder = user_builder(tmp_path, "pyb_add_one", {"csrc/add_one.cpp": PYBIND_SOURCE})
    module = builder.load()
    assert module.add_one(41) == 42
    assert "/proc/self/fd" not in repr(module), repr(module)
    assert str(module.__file__) in repr(module) and module.__spec__.origin == module.__file__


def test_verbose_says_nothing_about_cuda_for_an_op_without_cuda_sources(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    builder = user_builder(tmp_path, "cpu_only_twice", {"csrc/tagged.cpp": TAGGED.split("// def(schema")[0]})
    with caplog.at_level("WARNING", logger="opbuilder"):
        assert builder.is_compatible(verbose=True)
    assert caplog.records == [], [r.getMessage() for r in caplog.records]


# ---- a project moved or copied elsewhere ----------------------------------------------------------------


def test_a_project_with_sources_beside_the_builders_folder_keeps_its_key_when_moved(tmp_path: Path) -> None:
    # PyTorch's layout: the builder in python/, the sources in ../csrc, a header in ../include.
    files = {"../csrc/twice.cpp": '#include "twice.h"\n' + TAGGED.split("// def(schema")[0].replace(
                 "2 * in[i]", "kTwice * in[i]") + 'OPB_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }\n',
             "../include/twice.h": "#pragma once\nconstexpr float kTwice = 2.0f;\n"}
    a = user_builder(tmp_path / "a" / "python", "moved_twice", files, sources=["../csrc/twice.cpp"])
    a.include_paths = lambda: ["../include"]  # type: ignore[method-assign]
    a.refresh()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    b = user_builder(tmp_path / "b" / "python", "moved_twice", {}, sources=["../csrc/twice.cpp"])
    b.include_paths = lambda: ["../include"]  # type: ignore[method-assign]
    b.refresh()
    names = sorted(a.key_inputs()["files"])
    assert names[-2:] == ["project/csrc/twice.cpp", "project/include/twice.h"], names
    assert b.key_inputs()["files"] == a.key_inputs()["files"] and b.key == a.key
    # An edit in the copy is named as the reason for its build; the old names of the same bytes are not.
    (tmp_path / "b" / "include" / "twice.h").write_text("#pragma once\nconstexpr float kTwice = 3.0f;\n")
    b.refresh()
    assert b.key != a.key


def test_the_reason_for_a_build_is_a_change_of_content_not_of_name(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import time

    from opbuilder import build, cache

    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    old = {f"/old/place/csrc/f{i}.cpp": f"{i:064x}" for i in range(13)}
    (tmp_path / "cache" / "op" / "k1").mkdir(parents=True)
    (tmp_path / "cache" / "op" / "k1" / cache.MANIFEST).write_text(
        json.dumps({"inputs": {"files": old}, "build_started": time.time()}))

    def reason(files: dict[str, str]) -> str:
        spec = build.BuildSpec(op="op", key="k2", name="op", namespace="ns", python_module=False, sources=[],
                               include_paths=[], cxx_args=[], nvcc_args=[], ldflags=[], with_cuda=False, archs=[],
                               inputs={"files": files})
        return build._reason(spec, cache.Slot("op", "k2"))

    moved = {k.replace("/old/place", "/new/place"): v for k, v in old.items()}
    assert reason(moved).startswith("the same files under other paths"), reason(moved)
    edited = dict(moved, **{"/new/place/csrc/f3.cpp": "e" * 64})
    assert reason(edited) == "f3.cpp changed"


# ---- a CUDA compile check without a GPU, also with a CPU-only torch (CI) ---------------------------------

CUDA_KERNEL = '''
#include <cstdint>

__global__ void twice_kernel(const float* x, float* y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = 2 * x[i];
}

void twice_cuda(const float* x, float* y, int64_t n) {  // on the default stream: a compile test
  if (n > 0) twice_kernel<<<(n + 255) / 256, 256>>>(x, y, n);
}
'''

# As kernels-community's bindings do: the CUDA impl is registered whatever was built.
CUDA_BINDING = TAGGED.split("// def(schema")[0] + '''
void twice_cuda(const float* x, float* y, int64_t n);

Tensor twice_on_gpu(const Tensor& x) {
  Tensor xc = torch::stable::contiguous(x);
  Tensor y = opb::new_output(xc);
  twice_cuda(static_cast<const float*>(xc.data_ptr()), static_cast<float*>(y.data_ptr()), xc.numel());
  return y;
}

OPB_LIBRARY(m) { m.def("twice(Tensor x) -> Tensor"); }
OPB_LIBRARY_IMPL(CPU, m) { m.impl("twice", TORCH_BOX(&twice)); }
OPB_LIBRARY_IMPL(CUDA, m) { m.impl("twice", TORCH_BOX(&twice_on_gpu)); }
'''

needs_nvcc = pytest.mark.skipif(toolchain.nvcc_path() is None, reason="needs nvcc (a CUDA toolkit), not a GPU")


def _cuda_op(project: Path, name: str):
    return user_builder(project, name, {"csrc/binding.cpp": CUDA_BINDING, "csrc/twice.cu": CUDA_KERNEL},
                        module="cuda_twice_ops")


@needs_nvcc
def test_compile_check_compiles_the_cuda_part_without_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from opbuilder.compile_check import compile_check
    from opbuilder.errors import BuildError

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the CUDA part is built and loaded as usual (the other tests)")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    builder = _cuda_op(tmp_path, "cuda_twice")
    skipped = builder.cuda_skip_reason()
    assert skipped is not None
    # Without archs the .cu file is skipped, and the check says so and why.
    plain = compile_check(builder)
    assert plain.ok and plain.compiled == [str(tmp_path / "csrc" / "binding.cpp")], plain
    assert plain.skipped == {str(tmp_path / "csrc" / "twice.cu"): "no CUDA arch to compile for: set "
                             "TORCH_CUDA_ARCH_LIST (e.g. 9.0) or pass the archs"}, plain.skipped
    # With archs it compiles with nvcc, whether or not torch has CUDA; nothing lands in the cache's builds.
    check = compile_check(builder, ["9.0"])
    assert check.ok and check.skipped == {} and check.archs == ["9.0"], check
    assert sorted(Path(f).name for f in check.compiled) == ["binding.cpp", "twice.cu"]
    # A load here builds the CPU part only; its library lacks the launcher, and the error says why.
    with pytest.raises(BuildError, match=r"twice_cuda\(float const\*, float\*, long\).*\n.*Not built here: twice\.cu: "):
        builder.load()


@needs_nvcc
def test_compile_check_reports_a_cuda_compile_error(tmp_path: Path) -> None:
    from opbuilder.compile_check import compile_check

    builder = _cuda_op(tmp_path, "cuda_twice_broken")
    (tmp_path / "csrc" / "twice.cu").write_text(CUDA_KERNEL.replace("2 * x[i];", "2 * x[i] +;"))
    builder.refresh()
    check = compile_check(builder, ["9.0"])
    assert not check.ok and list(check.failed) == [str(tmp_path / "csrc" / "twice.cu")]
    assert "error" in check.failed[str(tmp_path / "csrc" / "twice.cu")]


@needs_nvcc
def test_the_cli_compile_check_and_compile_commands_say_what_was_skipped(tmp_path: Path) -> None:
    import subprocess
    import sys

    _cuda_op(tmp_path, "cuda_twice_cli")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    env.pop("TORCH_CUDA_ARCH_LIST", None)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "opbuilder", *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)

    checked = cli("compile-check", "cuda_twice_ops:Builder", "--cuda-arch", "9.0")
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert f"cuda_twice_cli: compiled {tmp_path / 'csrc' / 'twice.cu'} (CUDA 9.0)" in checked.stdout, checked.stdout
    listed = cli("compile-commands", "cuda_twice_ops:Builder", "-o", str(tmp_path / "cc.json"))
    assert listed.returncode == 0, listed.stderr[-2000:]
    import torch

    if not torch.cuda.is_available():
        assert "wrote" in listed.stdout and "(1 files)" in listed.stdout
        assert "cuda_twice_cli: CUDA files not listed: " in listed.stderr, listed.stderr
    with_cuda = cli("compile-commands", "cuda_twice_ops:Builder", "--cuda-arch", "9.0", "-o", str(tmp_path / "cc.json"))
    assert with_cuda.returncode == 0 and "(2 files)" in with_cuda.stdout, with_cuda.stderr[-2000:]


@needs_nvcc
def test_the_same_op_builds_and_runs_on_a_gpu(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run on the GPU machine")
    ops = _cuda_op(tmp_path, "cuda_twice_gpu").load()
    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(ops.twice(x), x * 2, rtol=0, atol=0)
