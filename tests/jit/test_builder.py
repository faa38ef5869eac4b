"""The OpBuilder API: registry, flags, paths, environment, both binding styles, lock timeouts."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import copy_cache, run_python
from opbuilder import OpBuilder, UnknownOpError, env, get_builder
from opbuilder.jit.registry import names
from helpers.userop import load_snippet, write_user_op


def test_unknown_op_lists_known_names() -> None:
    with pytest.raises(UnknownOpError) as info:
        get_builder("rleu")
    message = str(info.value)
    assert "'rleu'" in message and all(name in message for name in names())


def test_registry_walks_every_builtin() -> None:
    for name in names():
        builder = get_builder(name)
        assert builder.name == name
        assert builder.BUILD_VAR == f"OPB_BUILD_{name.upper()}"
        assert all(p.is_file() for p in builder.all_sources()), builder.all_sources()


class TutorialStyle(OpBuilder):
    """Flags written as in the DeepSpeed tutorial: the subclass returns its own list only."""

    NAME = "tutorial_style"

    def sources(self) -> list[str]:
        return ["x.cpp"]

    def cxx_args(self) -> list[str]:
        return ["-O2", "-DMY_FLAG"]

    def nvcc_args(self) -> list[str]:
        return ["--use_fast_math"]


class ExtendingStyle(TutorialStyle):
    def cxx_args(self) -> list[str]:
        return OpBuilder.cxx_args(self) + ["-DMY_FLAG"]


def test_base_flags_are_kept_and_not_doubled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    base = OpBuilder.cxx_args(TutorialStyle())
    assert any(flag in base for flag in ("-std=c++17", "-std=c++20")) and "-O3" in base
    replaced = TutorialStyle().final_cxx_args()
    assert replaced[: len(base)] == base and replaced[len(base):] == ["-O2", "-DMY_FLAG"]
    extended = ExtendingStyle().final_cxx_args()
    assert extended == base + ["-DMY_FLAG"]
    nvcc = TutorialStyle().final_nvcc_args()
    assert "-gencode=arch=compute_90,code=sm_90" in nvcc
    assert "-gencode=arch=compute_90,code=compute_90" in nvcc
    assert "-gencode=arch=compute_80,code=sm_80" in nvcc
    assert nvcc[-1] == "--use_fast_math"


def test_paths_are_relative_to_the_defining_module() -> None:
    assert TutorialStyle().source_root() == Path(__file__).resolve().parent
    assert TutorialStyle().all_sources() == [Path(__file__).resolve().parent / "x.cpp"]
    assert get_builder("relu").source_root().name == "kernels"


def test_missing_sources_make_the_op_incompatible() -> None:
    builder = TutorialStyle()
    assert not builder.is_compatible()
    assert any("x.cpp" in reason for reason in builder.incompatibility_reasons())


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch path")
def test_cpu_torch_builds_the_cpu_part_and_says_why() -> None:
    builder = get_builder("relu")
    assert builder.is_compatible()
    assert builder.cuda_skip_reason() == "torch was built without CUDA"
    assert all(not s.endswith(".cu") for s in builder.build_spec().sources)


def test_arch_list_parsing() -> None:
    from opbuilder.jit.toolchain import parse_arch_list

    assert parse_arch_list("9.0;8.0 8.6+PTX") == ["8.0", "8.6+PTX", "9.0"]
    assert parse_arch_list("9.0a") == ["9.0a"]
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST: expected entries like '9.0'"):
        parse_arch_list("Hopper")


def test_cache_root_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OPB_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.cache_root() == tmp_path / "xdg" / "opbuilder"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert env.cache_root() == tmp_path / "home" / ".cache" / "opbuilder"
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "mine"))
    assert env.cache_root() == tmp_path / "mine"


def test_bad_lock_timeout_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="OPB_LOCK_TIMEOUT must be a number of seconds, got 'soon'"):
        env.lock_timeout()


def test_lock_timeout_names_the_lock_file(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    sys.path.insert(0, str(op))
    try:
        from my_ops import AddScaleBuilder
        from filelock import FileLock

        slot_lock = fresh_cache / "add_scale" / f"{AddScaleBuilder().key}.lock"
        slot_lock.parent.mkdir(parents=True)
        with FileLock(str(slot_lock)):
            result = run_python(load_snippet(op), env={"OPB_LOCK_TIMEOUT": "1"})
        assert result.returncode != 0
        assert "CacheLockTimeout" in result.stderr and str(slot_lock) in result.stderr
        assert "OPB_LOCK_TIMEOUT" in result.stderr
    finally:
        sys.path.remove(str(op))
        sys.modules.pop("my_ops", None)


def test_a_held_work_folder_lock_times_out_too(tmp_path: Path, fresh_cache: Path) -> None:
    """The work folder (objects kept across keys of one op) has its own lock, held while another process
    compiles there: a build waits for it as long as for the key's lock, then says which lock it gave up on
    (it waited for ever: a hung compiler in one process hung every build of the op), and records no failure."""
    from opbuilder import paths
    from opbuilder.jit import compile
    from opbuilder.jit.locks import FileLock

    op = write_user_op(tmp_path / "proj")
    sys.path.insert(0, str(op))
    try:
        from my_ops import AddScaleBuilder

        builder = AddScaleBuilder()
        work_lock = paths.work_lock(compile.work_dir("add_scale", builder.key_inputs()))
        with FileLock(work_lock):
            result = run_python(load_snippet(op), env={"OPB_LOCK_TIMEOUT": "1"}, timeout=120)
        assert result.returncode != 0
        assert "CacheLockTimeout" in result.stderr and str(work_lock) in result.stderr, result.stderr[-3000:]
        assert "OPB_LOCK_TIMEOUT" in result.stderr
        assert not paths.failure("add_scale", builder.key).exists()
        result = run_python(load_snippet(op))  # the lock free again: it builds
        assert result.returncode == 0 and "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in result.stdout, result.stderr[-3000:]
    finally:
        sys.path.remove(str(op))
        sys.modules.pop("my_ops", None)


def test_two_versions_of_one_op_load_in_one_process(built_user_op: tuple[Path, Path], tmp_path: Path,
                                                    fresh_cache: Path) -> None:
    copy_cache(built_user_op[1], fresh_cache)  # v1 is the built op: only v2 builds
    one = write_user_op(tmp_path / "v1", offset=1.0)
    two = write_user_op(tmp_path / "v2", offset=5.0)
    code = textwrap.dedent(f"""
        import importlib.util, torch
        def builder(path):
            spec = importlib.util.spec_from_file_location("my_ops_" + path[-2:], path + "/my_ops.py")
            mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
            return mod.AddScaleBuilder()
        a, b = builder({str(one)!r}), builder({str(two)!r})
        x = torch.ones(3)
        print("V1", a.load().add_scale(x).tolist(), "V2", b.load().add_scale(x).tolist(), a.namespace != b.namespace)
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "V1 [3.0, 3.0, 3.0] V2 [7.0, 7.0, 7.0] True" in result.stdout


TUTORIAL_BUILDER = '''
from opbuilder import OpBuilder


class FusedReLULNBuilder(OpBuilder):
    BUILD_VAR = "DS_BUILD_FUSED_RELU_LN"
    NAME = "fused_relu_ln"

    def __init__(self):
        super().__init__(name=self.NAME)

    def sources(self):
        return ["csrc/fused_relu_ln.cpp"]

    def include_paths(self):
        return ["csrc"]

    def cxx_args(self):
        return ["-O3"]

    def nvcc_args(self):
        return ["-O3", "--use_fast_math"]
'''

TUTORIAL_SOURCE = r'''
#include <torch/extension.h>
#include <cmath>

// y = layer_norm(relu(x)) over the last dim, no affine: the tutorial's op, on the CPU.
torch::Tensor fused_relu_ln_forward(torch::Tensor x, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "x must be float32");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t cols = xc.size(-1), rows = xc.numel() / cols;
  const float* in = xc.data_ptr<float>();
  float* out = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < cols; ++c) mean += std::max(in[r * cols + c], 0.f);
    mean /= cols;
    for (int64_t c = 0; c < cols; ++c) { double d = std::max(in[r * cols + c], 0.f) - mean; var += d * d; }
    const double rstd = 1.0 / std::sqrt(var / cols + eps);
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = (std::max(in[r * cols + c], 0.f) - mean) * rstd;
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &fused_relu_ln_forward, "fused ReLU + LayerNorm (CPU)");
}
'''


def test_deepspeed_tutorial_builder_with_pybind(tmp_path: Path, fresh_cache: Path) -> None:
    (tmp_path / "proj" / "csrc").mkdir(parents=True)
    (tmp_path / "proj" / "fused_ops.py").write_text(TUTORIAL_BUILDER)
    (tmp_path / "proj" / "csrc" / "fused_relu_ln.cpp").write_text(TUTORIAL_SOURCE)
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path / 'proj')!r})
        from fused_ops import FusedReLULNBuilder

        class FusedReLULN(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.op = FusedReLULNBuilder().load()
            def forward(self, x):
                return self.op.forward(x, 1e-5)

        x = torch.randn(6, 33)
        got = FusedReLULN()(x)
        ref = torch.nn.functional.layer_norm(torch.relu(x), (33,), eps=1e-5)
        print("MAXERR", float((got - ref).abs().max()))
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    err = float(result.stdout.split("MAXERR")[1])
    assert err < 1e-5


def test_compiler_without_shared_cxx_runtime_gets_it_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A g++ that only has libstdc++.a would give each op its own C++ runtime, whose locale is never
    set up (number formatting in an error message then crashes): such a compiler links libstdc++.so.6."""
    from opbuilder.jit import toolchain

    fake = tmp_path / "bin" / "g++"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncase "$1" in\n  --version) echo "g++ (static runtime) 13.3.0";;\n'
                    '  -print-file-name=*) echo "libstdc++.so";;\nesac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake))
    assert toolchain.libstdcxx_ldflags() == ["-Wl,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--as-needed"]
    monkeypatch.setenv("CXX", "g++")
    assert toolchain.libstdcxx_ldflags() == []


PARALLEL_BUILDER = '''
from opbuilder import OpBuilder


class ThreadsBuilder(OpBuilder):
    NAME = "threads_used"

    def sources(self):
        return ["threads_used.cpp"]

    def extra_ldflags(self):  # its own list, no super(): the base flags must still come first
        return ["-Wl,--as-needed"]
'''

PARALLEL_SOURCE = """
#include <opbuilder/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <atomic>

namespace {
// How many threads at::parallel_for ran x.numel() one-element chunks on.
int64_t threads_used(const at::Tensor& x) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, x.numel(), 1, [&](int64_t, int64_t) { seen |= uint64_t(1) << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}
}  // namespace

OPB_LIBRARY(m) { m.def("threads_used(Tensor x) -> int"); }
OPB_LIBRARY_IMPL(CPU, m) { m.impl("threads_used", &threads_used); }
"""


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="needs two CPUs to see two threads")
def test_parallel_for_in_an_op_runs_on_torchs_threads(tmp_path: Path, fresh_cache: Path) -> None:
    """torch's cpp_extension alone compiles an op without OpenMP, and ATen's inline parallel_for then runs
    every chunk on the calling thread. The base flags make it use torch's thread pool (one OpenMP runtime)."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "my_ops.py").write_text(PARALLEL_BUILDER)
    (tmp_path / "proj" / "threads_used.cpp").write_text(PARALLEL_SOURCE)
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path / 'proj')!r})
        from my_ops import ThreadsBuilder
        torch.set_num_threads(2)
        ops = ThreadsBuilder().load()
        used = ops.threads_used(torch.empty(10000))
        runtimes = sorted({{line.split()[-1] for line in open("/proc/self/maps") if "omp" in line.split("/")[-1]}})
        print("THREADS", used, "RUNTIMES", len(runtimes))
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "THREADS 2 RUNTIMES 1" in result.stdout, result.stdout


def test_openmp_flags_follow_the_compiler_and_torchs_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from opbuilder.jit import toolchain

    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    cxx_args, ldflags = toolchain.openmp_flags()
    if sys.platform == "linux" and torch.backends.openmp.is_available():
        assert cxx_args == ["-fopenmp"] and len(ldflags) == 1
        assert Path(ldflags[0]).is_file() and Path(ldflags[0]).name.startswith(("libgomp", "libiomp5", "libomp."))
        assert "-fopenmp" in OpBuilder.cxx_args(TutorialStyle()) and ldflags[0] in OpBuilder.extra_ldflags(TutorialStyle())
    # A compiler without OpenMP (omp.h not found) gets none, and the op's loops stay serial.
    fake = tmp_path / "bin" / "g++"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncase "$1" in\n  --version) echo "g++ (no openmp) 13.3.0";;\n'
                    '  -print-file-name=*) echo "/usr/lib/libstdc++.so";;\n  -fopenmp) exit 1;;\nesac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert toolchain.openmp_flags() == ([], [])
