"""DeepSpeed's builder API on opbuilder's build: DeepSpeed's own op builder files run with one import changed.

A DeepSpeed builder file (``op_builder/cpu_adam.py``, ``op_builder/cpu/cpu_adam.py``, ``op_builder/fused_adam.py``,
...) imports its base class from DeepSpeed's ``builder.py``. Change that one line::

    from .builder import CUDAOpBuilder, installed_cuda_version       # DeepSpeed
    from opbuilder.deepspeed import CUDAOpBuilder, installed_cuda_version

and ``load()`` compiles into opbuilder's content-addressed cache under its crash-safe lock, with its
progress lines, and later processes only load. The classes keep DeepSpeed's method names and meanings:

- ``sources()`` and ``include_paths()`` are relative to the nearest folder above the builder's file that
  holds ``csrc/`` (DeepSpeed's package root in its own layout; absolute paths stay as they are).
- ``cxx_args()``, ``nvcc_args()``, ``extra_ldflags()`` are the op's own flags, which may hold empty
  strings (stripped, as DeepSpeed does); opbuilder's base flags (``-O3``, the C++ standard, OpenMP,
  ``-march``, ``-gencode`` for the archs) come first, and DeepSpeed's JIT additions last
  (``-UC10_USE_GLOG``; with CUDA archs of sm_80 and newer only, ``-DBF16_AVAILABLE`` and nvcc's
  ``-U__CUDA_NO_BFLOAT16_*``). ``libraries_args()`` is linked as ``-l`` flags.
- ``cpu_arch()`` is ``-march=`` of ``OPB_CPU_ARCH`` (``native`` unless set; ``''`` when ``none``).
  ``simd_width()`` is the SIMD path that target has, asked of the C++ compiler (``-D__AVX512__``,
  ``-D__AVX256__``, ``-D__SVE__``, ``-D__NEON__``, else ``-D__SCALAR__``), so the define never asks
  for instructions the ``-march`` does not enable.
- CUDA archs are opbuilder's (``TORCH_CUDA_ARCH_LIST``, else the visible GPUs) after the builder's
  ``filter_ccs()``; ``compute_capability_args()`` returns their ``-gencode`` flags (given once).
  ``build_for_cpu`` is True when CUDA cannot be built here (torch without CUDA, no nvcc, no arch).
- ``is_compatible(verbose)`` is the builder's own check on top of opbuilder's (sources present,
  compiler found, CUDA buildable when the op has ``.cu`` sources); ``load()`` refuses an incompatible op
  with ``IncompatibleOpError`` (a ``RuntimeError``) naming the reason, as DeepSpeed's ``jit_load`` does.

Left out, each saying so when reached: ROCm/HIP (``hipify``), SYCL, and ``builder()`` (a setuptools
extension DeepSpeed's ``setup.py`` installs into its package; here ``prebuild()`` compiles into the cache
instead, chosen with ``DS_BUILD_*`` or ``OPB_BUILD_*``). nvcc's ``--threads`` is not passed: opbuilder
schedules the compilers itself, and a flag that varies with the machine's cores would split the key.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from opbuilder import env
from opbuilder.errors import IncompatibleOpError
from opbuilder.jit import builder as _base, toolchain

__all__ = [
    "CPUOpBuilder",
    "CUDAMismatchException",
    "CUDAOpBuilder",
    "MissingCUDAException",
    "OpBuilder",
    "TorchCPUOpBuilder",
    "get_default_compute_capabilities",
    "installed_cuda_version",
    "prebuild",
]

log = logging.getLogger("opbuilder")


class MissingCUDAException(IncompatibleOpError):
    """No CUDA toolkit (nvcc) to compile with."""


class CUDAMismatchException(IncompatibleOpError):
    """DeepSpeed's name, kept for ``except`` clauses; opbuilder keys a build by its nvcc instead of refusing it."""


def installed_cuda_version(name: str = "") -> tuple[int, int]:
    """(major, minor) of the nvcc opbuilder compiles with. Raises MissingCUDAException when there is none."""
    nvcc = toolchain.nvcc_path()
    if nvcc is None:
        raise MissingCUDAException(f"{name + ': ' if name else ''}nvcc not found, unable to compile CUDA ops (set CUDA_HOME)")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise MissingCUDAException(f"{nvcc} --version failed: {exc}") from None
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        raise MissingCUDAException(f"cannot read the CUDA release from `{nvcc} --version`: {out.strip()[-200:]!r}")
    return int(match.group(1)), int(match.group(2))


def get_default_compute_capabilities() -> str:
    """The archs opbuilder builds for here, as DeepSpeed writes them ('8.0;9.0')."""
    return ";".join(toolchain.cuda_archs())


@functools.lru_cache(maxsize=None)
def _predefined_macros(compiler: str, arch_flag: str) -> frozenset[str]:
    """The macros ``compiler`` predefines under ``arch_flag`` (``__AVX512F__``, ``__ARM_FEATURE_SVE``, ...)."""
    args = [compiler, *([arch_flag] if arch_flag else []), "-dM", "-E", "-x", "c++", "-"]
    try:
        out = subprocess.run(args, input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define "))


class OpBuilder(_base.OpBuilder):
    """DeepSpeed's ``OpBuilder``: a builder declares ``NAME``, ``BUILD_VAR``, ``absolute_name()``,
    ``sources()`` and its flags; ``load()`` builds through opbuilder (see the module's docstring)."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.jit_mode = True  # opbuilder always compiles on first use
        self.enable_bf16 = False
        self.error_log: str | None = None

    # ---- what a DeepSpeed builder declares -------------------------------------------------------

    def cxx_args(self) -> list[str]:
        return []

    def nvcc_args(self) -> list[str]:
        return []

    def extra_ldflags(self) -> list[str]:
        return []

    def libraries_args(self) -> list[str]:
        return []

    def source_root(self) -> Path:
        """The nearest folder above the builder's file (its own included) that holds ``csrc/``;
        the builder's folder when none does."""
        here = super().source_root()
        return next((p for p in (here, *here.parents) if (p / "csrc").is_dir()), here)

    def deepspeed_src_path(self, code_path: str) -> str:
        return code_path if os.path.isabs(code_path) else os.path.join(self.source_root(), code_path)

    # ---- DeepSpeed's helpers ---------------------------------------------------------------------

    def strip_empty_entries(self, args: Iterable[str]) -> list[str]:
        """``args`` without its empty strings (DeepSpeed's builders write ``''`` for "no flag")."""
        return [x for x in args if len(x) > 0]

    def cpu_arch(self) -> str:
        """The CPU target flag: ``-march=`` of OPB_CPU_ARCH (default ``native``), ``-mcpu=`` on POWER,
        ``''`` when OPB_CPU_ARCH is ``none``."""
        arch = env.cpu_arch()
        if arch is None:
            return ""
        machine = platform.machine().lower()
        if machine.startswith(("ppc", "powerpc")):
            return f"-mcpu={arch}"
        if machine.startswith("riscv") and arch == "native":
            return "-march=rv64gc"
        return f"-march={arch}"

    def simd_width(self) -> str:
        """DeepSpeed's SIMD define for what ``cpu_arch()`` enables, as the C++ compiler reports it."""
        cxx = toolchain.cxx_path()
        macros = _predefined_macros(cxx, self.cpu_arch()) if cxx else frozenset()
        if "__AVX512F__" in macros:
            return "-D__AVX512__"
        if "__AVX2__" in macros:
            return "-D__AVX256__"
        if "__ARM_FEATURE_SVE" in macros:
            return "-D__SVE__"
        if "__aarch64__" in macros:  # NEON is baseline on AArch64 (simd.h's vdivq/vsqrtq are A64-only)
            return "-D__NEON__"
        return "-D__SCALAR__"

    def warning(self, msg: str) -> None:
        """Log ``msg`` and keep it as the reason ``load()`` gives if the op turns out incompatible."""
        self.error_log = f"{msg}"
        log.warning("%s", msg)

    def command_exists(self, cmd: str) -> bool:
        """Whether one of the commands ``cmd`` names ("a|b" for either) is on PATH."""
        cmds = cmd.split("|")
        if any(toolchain.which(c.strip()) for c in cmds):
            return True
        self.warning(f"{self.name} requires {'one of the commands ' + repr(cmds) if len(cmds) > 1 else repr(cmd)}, "
                     "which is not on PATH")
        return False

    def has_function(self, funcname: str, libraries: list[str], library_dirs: list[str] | None = None,
                     verbose: bool = False) -> bool:
        """Whether a C program calling ``funcname`` compiles and links against ``libraries``."""
        cxx = toolchain.cxx_path()
        if cxx is None:
            return False
        with tempfile.TemporaryDirectory(prefix="opb-has-function-") as tmp:
            src = Path(tmp) / "test.c"
            src.write_text(f"void {funcname}(void); int main(void) {{ {funcname}(); return 0; }}\n")
            cmd = [cxx, "-x", "c", str(src), "-o", str(Path(tmp) / "a.out"),
                   *(f"-L{d}" for d in library_dirs or []), *(f"-l{lib}" for lib in libraries)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                return False
        if verbose and out.returncode != 0:
            log.warning("%s: %s", " ".join(cmd), out.stderr.strip()[-2000:])
        return out.returncode == 0

    @staticmethod
    def is_rocm_pytorch() -> bool:
        import torch

        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def is_sycl_enabled() -> bool:
        return False

    def _unsupported(self, what: str) -> IncompatibleOpError:
        return IncompatibleOpError(f"{self.name}: {what}: opbuilder builds CPU and CUDA ops only "
                                   "(no ROCm/HIP hipify, no SYCL)")

    def installed_rocm_version(self) -> tuple[int, int]:
        raise self._unsupported("the builder asks for the ROCm version")

    def get_rocm_gpu_arch(self) -> str:
        raise self._unsupported("the builder asks for the ROCm GPU arch")

    def get_rocm_wavefront_size(self) -> str:
        raise self._unsupported("the builder asks for the ROCm wavefront size")

    def hipify_extension(self) -> None:
        """Nothing to do: opbuilder builds no HIP sources (a ROCm torch makes a CUDA op incompatible)."""

    def sycl_extension(self) -> None:
        """Nothing to do: opbuilder builds no SYCL sources."""

    def builder(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__}.builder(): opbuilder does not compile DeepSpeed-style ops into a wheel at "
            "install time; load() compiles into the cache on first use. To compile ahead of time (a container "
            "build, once per node), call opbuilder.deepspeed.prebuild([...]) with DS_BUILD_<OP>=1 or "
            "OPB_BUILD_<OP>=1 set (see the README, 'Moving from DeepSpeed')."
        )

    # ---- compatibility and loading -----------------------------------------------------------------

    def _build_reasons(self) -> list[str]:
        """What opbuilder needs to build the op that is missing here (a subclass adds its own)."""
        return _base.OpBuilder.incompatibility_reasons(self)

    def is_compatible(self, verbose: bool = False) -> bool:
        """DeepSpeed's check (a subclass extends it); here: what opbuilder needs to build the op."""
        reasons = self._build_reasons()
        if verbose:
            for reason in reasons:
                self.warning(f"{self.name} is not compatible: {reason}")
        return not reasons

    def incompatibility_reasons(self) -> list[str]:
        """opbuilder's reasons, then the builder's own ``is_compatible()`` verdict with its last warning."""
        reasons = self._build_reasons()
        if not reasons and not self.is_compatible(False):
            reasons = [self.error_log or f"{type(self).__name__}.is_compatible() returned False"]
        return reasons

    def jit_load(self, verbose: bool = True) -> Any:
        """The same as ``load()``: opbuilder compiles on first use in any case."""
        return self.load(verbose)

    # ---- the flags opbuilder compiles with -------------------------------------------------------

    def _bf16(self) -> bool:
        return False

    def final_cxx_args(self) -> list[str]:
        return self.strip_empty_entries(super().final_cxx_args()) + ["-UC10_USE_GLOG"] + (
            ["-DBF16_AVAILABLE"] if self._bf16() else [])

    def final_nvcc_args(self) -> list[str]:
        args, seen = [], set()
        for arg in self.strip_empty_entries(super().final_nvcc_args()):
            if arg.startswith("-gencode"):  # the base's and compute_capability_args()'s: once each
                if arg in seen:
                    continue
                seen.add(arg)
            args.append(arg)
        bf16 = ["-DBF16_AVAILABLE", "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
        return args + ["-UC10_USE_GLOG"] + (bf16 if self._bf16() else [])

    def final_ldflags(self) -> list[str]:
        return self.strip_empty_entries(super().final_ldflags()) + [
            f"-l{lib}" for lib in self.strip_empty_entries(self.libraries_args())]


#: Libraries whose headers ATen's CUDA headers (``ATen/cuda/CUDAContext.h``) include.
_ATEN_CUDA_HEADERS = ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h")


class CUDAOpBuilder(OpBuilder):
    """DeepSpeed's ``CUDAOpBuilder``: an op with ``.cu`` sources, compiled for opbuilder's CUDA archs."""

    def filter_ccs(self, ccs: list[str]) -> list[list[str]]:
        """The archs this op builds for, as [major, minor] pairs; a subclass prunes (DeepSpeed's hook)."""
        return [cc.split(".") for cc in ccs]

    def cuda_archs(self) -> list[str]:
        """opbuilder's archs after ``filter_ccs()``, asked once per list of archs (it may log what it prunes)."""
        archs = tuple(_base.OpBuilder.cuda_archs(self))
        if self.__dict__.get("_filtered_from") != archs:
            kept = self.filter_ccs(list(archs))
            self.__dict__["_filtered"] = [cc if isinstance(cc, str) else ".".join(cc) for cc in kept]
            self.__dict__["_filtered_from"] = archs
        return list(self.__dict__["_filtered"])

    def cuda_toolchain_reason(self) -> str | None:
        if self.is_rocm_pytorch():
            return "torch is a ROCm build, and opbuilder does not hipify or build HIP ops"
        offered = _base.OpBuilder.cuda_archs(self)
        if not self.cuda_archs() and offered:
            return (f"its filter_ccs() keeps none of the CUDA archs {';'.join(offered)} "
                    "(set TORCH_CUDA_ARCH_LIST to archs it supports)")
        return super().cuda_toolchain_reason()

    @property
    def build_for_cpu(self) -> bool:
        """True when CUDA cannot be compiled here (DeepSpeed: no GPU at JIT time)."""
        return self.cuda_toolchain_reason() is not None

    def _build_reasons(self) -> list[str]:
        reasons = super()._build_reasons()
        has_cuda_sources = any(p.suffix in _base.CUDA_SUFFIXES for p in self.all_sources())
        why = self.cuda_skip_reason()
        if has_cuda_sources and why is not None and not any(why in r for r in reasons):
            reasons.append(f"its .cu sources cannot be compiled here: {why}")
        return reasons

    def cuda_capability_major(self) -> int | None:
        """Compute capability major of GPU 0 when CUDA is already initialised (never initialises it)."""
        import torch

        if not torch.cuda.is_initialized():
            return None
        if hasattr(torch.cuda, "_is_in_bad_fork") and torch.cuda._is_in_bad_fork():
            return None
        return torch.cuda.get_device_properties(0).major

    def compute_capability_args(self, cross_compile_archs: str | None = None) -> list[str]:
        """``-gencode`` flags for the archs this op builds for (``cross_compile_archs`` is ignored, as in
        DeepSpeed's JIT mode: the archs are TORCH_CUDA_ARCH_LIST's or the visible GPUs')."""
        archs = self.cuda_archs()
        if not archs:
            raise IncompatibleOpError(f"{self.name}: no CUDA arch to compile for: {self.cuda_toolchain_reason()}")
        self.enable_bf16 = self._bf16()
        return toolchain.gencode_flags(archs)

    def final_nvcc_args(self) -> list[str]:
        """DeepSpeed's ``.cu`` files include ATen's CUDA headers, which include cuSPARSE's, cuBLAS's and
        cuSOLVER's: where the toolkit lacks them (nvcc alone, the libraries from torch's nvidia wheels),
        their folder is searched last (``-isystem`` after the toolkit's, so the toolkit's own headers win)."""
        home = toolchain.cuda_home()
        toolkit = os.path.realpath(os.path.join(home, "include")) if home else None
        found = (toolchain.cuda_header_dir(header) for header in _ATEN_CUDA_HEADERS)
        dirs = dict.fromkeys(str(d) for d in found if d is not None)
        return super().final_nvcc_args() + [arg for d in dirs if os.path.realpath(d) != toolkit for arg in ("-isystem", d)]

    def _bf16(self) -> bool:
        archs = self.cuda_archs()
        return self.with_cuda() and bool(archs) and all(int(a.split(".")[0]) >= 8 for a in archs)

    def version_dependent_macros(self) -> list[str]:
        return ["-DVERSION_GE_1_1", "-DVERSION_GE_1_3", "-DVERSION_GE_1_5"]  # torch >= 1.5, always here

    def cxx_args(self) -> list[str]:
        return ["-O3", toolchain.cxx_standard(), "-g", "-Wno-reorder"]

    def nvcc_args(self) -> list[str]:
        if self.build_for_cpu:
            return []
        major, minor = installed_cuda_version(self.name)
        std = "-std=c++20" if (major, minor) >= (12, 5) else "-std=c++17" if major > 10 else "-std=c++14"
        return ["-O3", "--use_fast_math", std, "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_HALF2_OPERATORS__", *self.compute_capability_args()]


class TorchCPUOpBuilder(CUDAOpBuilder):
    """DeepSpeed's ``TorchCPUOpBuilder`` (DeepSpeed up to 0.18): CPU code built beside torch's CUDA
    (linking cuRAND/cuBLAS when CUDA can be compiled here)."""

    def get_cuda_lib64_path(self) -> str:
        home = toolchain.cuda_home()
        if home is None:
            raise MissingCUDAException(f"{self.name}: no CUDA toolkit found (set CUDA_HOME)")
        lib64 = os.path.join(home, "lib64")
        return lib64 if os.path.exists(lib64) else os.path.join(home, "lib")

    def get_cuda_compile_flag(self) -> str:
        return "-D__DISABLE_CUDA__" if self.build_for_cpu else "-D__ENABLE_CUDA__"

    def extra_ldflags(self) -> list[str]:
        if self.build_for_cpu:
            return ["-fopenmp"]
        curand = toolchain.find_cuda_library("curand")  # the toolkit's, or that of torch's nvidia wheel
        return curand.ldflags() if curand is not None else ["-lcurand", f"-L{self.get_cuda_lib64_path()}"]

    def cxx_args(self) -> list[str]:
        args = []
        if not self.build_for_cpu:
            args += super().cxx_args() + [f"-L{self.get_cuda_lib64_path()}", "-lcudart", "-lcublas", "-g"]
        return args + [self.cpu_arch(), "-fopenmp", self.simd_width(), self.get_cuda_compile_flag()]


class CPUOpBuilder(OpBuilder):
    """DeepSpeed's ``CPUOpBuilder`` (``op_builder/cpu/builder.py``, DeepSpeed 0.19 on)."""

    def cxx_args(self) -> list[str]:
        return ["-O3", "-g", "-Wno-reorder", self.cpu_arch(), "-fopenmp", self.simd_width()]


def prebuild(builders: Iterable[OpBuilder], verbose: bool = False) -> list[str]:
    """Compile into the cache the builders the environment asks for, as DeepSpeed's install does.

    An op is asked for by ``OPB_BUILD_<NAME>`` or, when that is unset, its ``BUILD_VAR``
    (``DS_BUILD_<NAME>``); either set to 0 excludes it. ``OPB_BUILD_OPS=1`` or ``DS_BUILD_OPS=1`` ask for
    every op that can be built here (one that cannot is skipped with a logged reason). Returns the names
    of the ops compiled or found in the cache. Raises IncompatibleOpError for an op asked for by name that
    cannot be built here, and what ``load()`` raises.
    """
    done = []
    for op in builders:
        wanted = env.build_var(f"OPB_BUILD_{op.name.upper()}")
        if wanted is None and op.BUILD_VAR:
            wanted = env.build_var(op.BUILD_VAR)
        named = wanted is True
        if wanted is None:
            wanted = env.build_all_ops() or env.build_all_ds_ops()
        if not wanted:
            continue
        reasons = op.incompatibility_reasons()
        if reasons and not named:
            log.warning("opbuilder: not prebuilding %s: %s", op.name, "; ".join(reasons))
            continue
        op.load(verbose)
        done.append(op.name)
    return done
