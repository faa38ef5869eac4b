"""``OpBuilder``: an op declares its sources and flags; this base class does the rest.

A subclass declares (``NAME``, ``sources()``, maybe ``include_paths()``, ``cxx_args()``,
``nvcc_args()``); ``load()`` compiles on first use into the content-addressed cache and loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from functools import cached_property
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from opbuilder import env
from opbuilder.errors import IncompatibleOpError
from opbuilder.jit import fingerprint, toolchain
from opbuilder.paths import INCLUDE_DIR, key_memo

if TYPE_CHECKING:
    from opbuilder.jit import prebuilt
    from opbuilder.jit.build import BuildSpec

log = logging.getLogger("opbuilder")

CUDA_SUFFIXES = (".cu",)

# What marks a source as written on the stable ABI, and what ties it to one torch build.
_STABLE_MARKERS, _CLASSIC_MARKERS = fingerprint.STABLE_MARKERS, fingerprint.CLASSIC_MARKERS

# An op's name becomes a folder of the cache and part of a C++ and torch.ops namespace.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME_MAX = 100  # a folder name may have 255 bytes; the op's work folders add a hash to it


def is_op_name(name: object) -> bool:
    """Whether ``name`` can name an op: letters, digits and '_' (not starting with a digit), at most 100."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and len(name) <= _NAME_MAX


# OPB_DEBUG: host and device debug info (line tables for compute-sanitizer; -G for cuda-gdb on request).
_DEBUG_CXX = {"host": ["-g"], "device": ["-g"]}
_DEBUG_NVCC = {"host": ["-g", "-lineinfo"], "device": ["-g", "-G"]}
# OPB_DEBUG=0 drops these from an op's own flags: -g, -g1..3, -ggdb[N], -gdwarf[-N]; nvcc's host and device
# debug, and the host compiler's through -Xcompiler (-Xcompiler -g, -Xcompiler=-g,-fPIC).
_CXX_DEBUG_FLAG = re.compile(r"-g(?:gdb|dwarf(?:-\d+)?)?[1-3]?")
_NVCC_DEBUG_FLAGS = frozenset({"-g", "--debug", "-G", "--device-debug", "-lineinfo", "--generate-line-info"})
_NVCC_HOST_OPTIONS = ("-Xcompiler", "--compiler-options")


def _debug_flags(args: list[str], added: dict[str, list[str]], nvcc: bool) -> list[str]:
    """``args`` with what OPB_DEBUG asks for: its flags added (1, device), or the op's own debug flags
    dropped (0)."""
    mode = env.debug()
    if mode != "none":
        return args + added.get(mode, [])
    if not nvcc:
        return [a for a in args if not _CXX_DEBUG_FLAG.fullmatch(a)]

    def host(value: str) -> str:  # -Xcompiler's comma-separated flags, less the debug ones
        return ",".join(v for v in value.split(",") if not _CXX_DEBUG_FLAG.fullmatch(v))

    kept: list[str] = []
    for arg in args:
        option, eq, value = arg.partition("=")
        if kept and kept[-1] in _NVCC_HOST_OPTIONS:  # the value of "-Xcompiler VALUE"
            option = kept.pop()
            if host(arg):
                kept += [option, host(arg)]
        elif eq and option in _NVCC_HOST_OPTIONS:  # "-Xcompiler=VALUE"
            if host(value):
                kept.append(f"{option}={host(value)}")
        elif arg not in _NVCC_DEBUG_FLAGS:
            kept.append(arg)
    return kept


def default_build_var(name: str) -> str:
    """``OPB_BUILD_<NAME>``: the variable that prebuilds an op at install time, unless its builder names
    another (``BUILD_VAR``)."""
    return f"OPB_BUILD_{name.upper()}"


def _unbuildable_paths(paths: list[Path], chars: str) -> list[str]:
    """Why paths holding one of ``chars`` cannot be built from: the build file torch.utils.cpp_extension
    writes for ninja escapes spaces in paths, but not '$' (a variable to ninja) or ':' (a rule's separator)."""
    reasons = []
    for path in paths:
        where = "the cache root (OPB_CACHE_DIR)" if path == env.cache_root() else "the path"
        todo = "point OPB_CACHE_DIR at another folder" if path == env.cache_root() else "move it"
        try:  # cpp_extension writes the build file as UTF-8: bytes that are not (a Latin-1 name) cannot go there
            str(path).encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(path).decode("utf-8", "backslashreplace")
            reasons.append(f"{where} '{shown}' is not valid UTF-8, which ninja's build file (written as UTF-8) "
                           f"cannot hold; {todo} (a folder whose name is UTF-8)")
            continue
        bad = sorted({c for c in str(path) if c in chars})
        if bad:
            reasons.append(f"{where} {str(path)!r} holds {', '.join(map(repr, bad))}, which ninja's build file "
                           f"cannot hold; {todo} (a folder without '$', ':' or a line break)")
    return reasons


class OpBuilder:
    """Base class of every op builder (built-in or the user's own).

    Paths returned by ``sources()`` and ``include_paths()`` are relative to ``source_root()``: the
    folder of the module that defines the builder, unless the builder overrides it.
    """

    NAME: str = ""
    BUILD_VAR: str | None = None
    #: Bump to force a rebuild when something outside the hashed files changes the binary.
    VERSION: str = "1"
    #: CUDA libraries the CUDA part links, e.g. ``("cublasLt",)``: found in the nvidia wheels or the
    #: toolkit, added to the include paths and link flags; when one is missing only the CPU part is built.
    CUDA_LIBRARIES: tuple[str, ...] = ()
    #: True for a ``PYBIND11_MODULE`` binding, False for ``TORCH_LIBRARY``; None: detect from the sources.
    PYTHON_MODULE: bool | None = None
    #: "stable" (LibTorch stable ABI: one binary for torch 2.10 and later, keyed by the ABI target),
    #: "classic" (ATen, ``torch/library.h``, pybind11: keyed by the exact torch); None: detect from the
    #: sources (stable when they include ``<opbuilder/stable.h>`` or ``torch/csrc/stable/`` and nothing classic).
    ABI: str | None = None

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME
        if not self.name:
            raise ValueError(f"{type(self).__name__}: set NAME (the op's name) or pass name=")
        if not is_op_name(self.name):
            label = f"{type(self).__name__}.NAME" if not name else f"{type(self).__name__}(name=...)"
            hint = re.sub(r"[^A-Za-z0-9_]+", "_", str(self.name)).strip("_")
            hint = f"op_{hint}" if hint[:1].isdigit() else hint
            raise ValueError(
                f"{label} must be letters, digits and '_' (ASCII, not starting with a digit, at most {_NAME_MAX} characters): it "
                f"names the op's cache folder and its torch.ops namespace; got {self.name!r}"
                + (f". Try {hint[:_NAME_MAX]!r}" if hint else "")
            )
        if self.BUILD_VAR is None:
            self.BUILD_VAR = default_build_var(self.name)

    # ---- what a subclass declares ------------------------------------------------------------

    def sources(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} must define sources()")

    def include_paths(self) -> list[str]:
        return []

    def cxx_args(self) -> list[str]:
        args = ["-O3", self._cxx_standard()] + toolchain.openmp_flags()[0]
        arch = env.cpu_arch()
        return args + ([f"-march={arch}"] if arch else [])

    def nvcc_args(self) -> list[str]:
        libs = [f"-I{lib.include_dir}" for lib in self._cuda_libraries() if lib is not None]
        return ["-O3", self._cxx_standard(), "--expt-relaxed-constexpr"] + libs + toolchain.gencode_flags(self.cuda_archs())

    def _cxx_standard(self) -> str:
        """The ABI target's standard for a stable-ABI op, else the one the installed torch's headers need.
        A ``-std=`` of the op's own flags comes later and wins."""
        if "_reading_flags" in self.__dict__:  # abi() or stable_target() reads the op's own flags: not known yet
            return toolchain.STABLE_CXX_STANDARD
        if self.abi() != "stable":
            return toolchain.cxx_standard()
        return toolchain.stable_cxx_standard(self.stable_target())

    def extra_ldflags(self) -> list[str]:
        flags = toolchain.libstdcxx_ldflags() + toolchain.openmp_flags()[1]
        if not self.CUDA_LIBRARIES or not self.with_cuda():
            return flags
        return flags + [flag for lib in self._cuda_libraries() if lib is not None for flag in lib.ldflags()]

    def _cuda_libraries(self) -> list[toolchain.CudaLibrary | None]:
        return [toolchain.find_cuda_library(name) for name in self.CUDA_LIBRARIES]

    def source_root(self) -> Path:
        module = sys.modules.get(type(self).__module__)
        module_file = getattr(module, "__file__", None)
        if module_file is None:  # a module executed without being registered in sys.modules
            module_file = type(self).sources.__code__.co_filename
        return Path(module_file).resolve().parent

    def absolute_name(self) -> str:
        """The importable name DeepSpeed builders report; here, the op's registered namespace."""
        return self.namespace

    # ---- what the base class works out -------------------------------------------------------

    #: Set on the copy ``for_cuda_check`` makes: the archs its CUDA part is compiled for, torch's CUDA or not.
    _check_archs: list[str] | None = None

    def cuda_archs(self) -> list[str]:
        return list(self._check_archs) if self._check_archs is not None else toolchain.cuda_archs()

    def for_cuda_check(self, archs: list[str] | None = None) -> OpBuilder:
        """A copy of this builder whose CUDA sources are compiled even where torch was built without CUDA or
        no GPU is visible (CI): for ``archs`` (default: TORCH_CUDA_ARCH_LIST). Only for compiling
        (``opbuilder.jit.compile_check``, ``opbuilder compile-commands --cuda-arch``): a CPU-only torch has no CUDA
        libraries to link. Raises IncompatibleOpError saying why when the CUDA part still cannot be compiled
        here (no CUDA sources, no nvcc, no archs, a CUDA library missing)."""
        import copy

        checker = copy.copy(self)
        checker.__dict__ = {k: v for k, v in self.__dict__.items() if k not in self._CACHED}
        checker._check_archs = toolchain.parse_arch_list(";".join(archs)) if archs else toolchain.cuda_archs_from_env()
        reason = checker.cuda_skip_reason()
        if reason is not None:
            raise IncompatibleOpError(f"op {self.name!r}: cannot compile its CUDA part here: {reason}")
        return checker

    def _resolve(self, paths: list[str]) -> list[Path]:
        root = str(self.source_root())
        return [Path(os.path.realpath(os.path.join(root, p))) for p in paths]

    def all_sources(self) -> list[Path]:
        """``sources()`` as absolute paths, worked out once per builder object."""
        return self._all_sources

    @cached_property
    def _all_sources(self) -> list[Path]:
        return self._resolve(self.sources())

    def built_sources(self, with_cuda: bool) -> list[Path]:
        """The sources a build compiles: all of them, or without the ``.cu`` files for a CPU-only build."""
        return [p for p in self.all_sources() if with_cuda or p.suffix not in CUDA_SUFFIXES]

    def file_digests(self, with_cuda: bool = True) -> dict[str, str]:
        """sha256 of each source a build compiles and of every project header they include."""
        return fingerprint.digest_files(self._project_files(with_cuda), self.digest_roots(), self._file_memo)

    def _project_files(self, with_cuda: bool) -> list[Path]:
        """The sources a build compiles and the project headers they include, found once per builder object."""
        found = self._project_files_of
        if with_cuda not in found:
            found[with_cuda] = fingerprint.project_files(self.built_sources(with_cuda), self._include_dirs(),
                                                         self._file_memo)
        return found[with_cuda]

    @cached_property
    def _file_memo(self) -> fingerprint.FileMemo:
        """Where the key reads the op's files: each is read and hashed once per builder object, and not at
        all while the cache's memo of it holds (``fingerprint.FileMemo``; not after ``refresh(rehash=True)``)."""
        return fingerprint.FileMemo(key_memo(self.name), trust=not self.__dict__.pop("_rehash", False))

    @cached_property
    def _project_files_of(self) -> dict[bool, list[Path]]:
        return {}

    def digest_roots(self) -> list[Path]:
        """What the key names files relative to (``fingerprint.ROOT_LABELS``): the builder's folder,
        opbuilder's headers, and the project: the folder holding the builder's folder, every source and
        every include path given relative to it (``../csrc`` as in PyTorch's layout). Moving or copying the
        project elsewhere keeps its keys; only a file outside all three is named by its absolute path."""
        root = self.source_root()
        inside = [os.path.dirname(p) for p in self.all_sources()]
        inside += [str(p) for p, rel in zip(self._resolve(self.include_paths()), self.include_paths())
                   if not os.path.isabs(rel)]
        return [root, INCLUDE_DIR, Path(os.path.commonpath([str(root), *inside]))]

    def cuda_skip_reason(self) -> str | None:
        """Why the CUDA sources will not be built here, or None when they will be."""
        if not any(p.suffix in CUDA_SUFFIXES for p in self.all_sources()):
            return "the op has no CUDA sources"
        reason = self.cuda_toolchain_reason()
        if reason is not None:
            return reason
        missing = [n for n, lib in zip(self.CUDA_LIBRARIES, self._cuda_libraries()) if lib is None]
        if missing:
            return f"CUDA libraries not found: {', '.join(missing)} (install their nvidia-* wheels or a full CUDA toolkit)"
        return None

    def cuda_toolchain_reason(self) -> str | None:
        """Why no CUDA source could be compiled here, whatever the op's sources, or None."""
        if toolchain.torch_cuda_version() is None and self._check_archs is None:
            return "torch was built without CUDA"
        if toolchain.nvcc_path() is None:
            return "nvcc not found (set CUDA_HOME)"
        if not self.cuda_archs():
            if self._check_archs is not None:
                return "no CUDA arch to compile for: set TORCH_CUDA_ARCH_LIST (e.g. 9.0) or pass the archs"
            return "no GPU is visible and TORCH_CUDA_ARCH_LIST is unset"
        return None

    def with_cuda(self) -> bool:
        return self.cuda_skip_reason() is None

    def incompatibility_reasons(self) -> list[str]:
        """Why this op cannot be built here at all (empty when it can)."""
        if not self.all_sources():
            return [f"{type(self).__name__}.sources() returned no files: list the op's .cpp (and .cu) files, "
                    f"relative to {self.source_root()}"]
        reasons = []
        missing = [str(p) for p in self.all_sources() if not p.is_file()]
        if missing:
            reasons.append(f"source files not found: {', '.join(missing)}")
        reasons += _unbuildable_paths([*self.all_sources(), env.cache_root()], "$:\n")
        reasons += _unbuildable_paths(self._include_dirs(), "$\n")
        if toolchain.cxx_path() is None:
            reasons.append(f"C++ compiler {env.cxx_compiler()!r} not found on PATH (set CXX)")
        if not any(p.suffix not in CUDA_SUFFIXES for p in self.all_sources()) and not self.with_cuda():
            reasons.append(f"the op has only CUDA sources and {self.cuda_skip_reason()}")
        if self.abi() == "stable":
            try:
                self.stable_target()
            except (IncompatibleOpError, ValueError) as exc:
                reasons.append(str(exc))
        return reasons

    def is_compatible(self, verbose: bool = False) -> bool:
        reasons = self.incompatibility_reasons()
        if verbose:
            for reason in reasons:
                log.warning("%s is not compatible: %s", self.name, reason)
            if not reasons and not self.with_cuda() and any(p.suffix in CUDA_SUFFIXES for p in self.all_sources()):
                log.warning("%s: building the CPU part only: %s", self.name, self.cuda_skip_reason())
        return not reasons

    def _composed(self, base: list[str], declared: list[str]) -> list[str]:
        """The base flags followed by the subclass's own; ``super().x() + [...]`` is not doubled."""
        extra = declared[len(base):] if declared[: len(base)] == base else declared
        return base + extra

    def final_cxx_args(self) -> list[str]:
        args = self._composed(OpBuilder.cxx_args(self), self.cxx_args())
        return _debug_flags(args + self._abi_flags(args), _DEBUG_CXX, nvcc=False) + (
            ["-DOPB_WITH_CUDA"] if self.with_cuda() else [])

    def final_nvcc_args(self) -> list[str]:
        args = self._composed(OpBuilder.nvcc_args(self), self.nvcc_args())
        return _debug_flags(args + self._abi_flags(args), _DEBUG_NVCC, nvcc=True)

    def _abi_flags(self, args: list[str]) -> list[str]:
        """-DOPB_STABLE_ABI and the stable API target, unless ``args`` (the op's own) already name one."""
        if self.abi() != "stable":
            return []
        flags = toolchain.stable_abi_flags(self.stable_target())
        return flags[:1] if toolchain.declared_target(args) else flags

    @contextlib.contextmanager
    def _reading_own_flags(self) -> Iterator[None]:
        """While abi() or stable_target() read the op's own flags, whose -std= depends on them."""
        outer = "_reading_flags" in self.__dict__
        self.__dict__["_reading_flags"] = True
        try:
            yield
        finally:
            if not outer:
                self.__dict__.pop("_reading_flags", None)

    def stable_target(self) -> tuple[int, int]:
        """The (major, minor) of the oldest torch a stable-ABI build of this op serves: the op's own
        ``-DTORCH_TARGET_VERSION=...`` in ``cxx_args()``/``nvcc_args()`` (for the later stable API it
        needs), else torch 2.10. Raises ValueError for a value that is not a version, and
        IncompatibleOpError for a target above the installed torch, whose headers lack that API."""
        return self._stable_target

    @cached_property
    def _stable_target(self) -> tuple[int, int]:
        with self._reading_own_flags():
            declared = toolchain.declared_target(self.cxx_args())
            if declared is None and self.with_cuda():
                declared = toolchain.declared_target(self.nvcc_args())
        if declared is None:
            return toolchain.STABLE_ABI_TARGET
        installed = toolchain.torch_version()
        if declared > installed:
            import torch

            raise IncompatibleOpError(
                f"op {self.name!r} asks for the stable API of torch {declared[0]}.{declared[1]} "
                f"(-DTORCH_TARGET_VERSION in its flags), but torch {torch.__version__} is installed: its headers "
                f"do not have that API and the library would not load here. Install torch "
                f">= {declared[0]}.{declared[1]}, or target {installed[0]}.{installed[1]} or older"
            )
        return declared

    def abi(self) -> str:
        """"stable" or "classic": how the op's binary depends on torch (see ``ABI``)."""
        if self.ABI is not None:
            if self.ABI not in ("stable", "classic"):
                raise ValueError(f"{type(self).__name__}.ABI must be 'stable', 'classic' or None, got {self.ABI!r}")
            return self.ABI
        return self._detected_abi

    @cached_property
    def _detected_abi(self) -> str:
        found: set[bytes] = set()
        memo = self._file_memo
        for path in fingerprint.project_files(self.all_sources(), self._include_dirs(), memo):
            if path.is_relative_to(INCLUDE_DIR):  # opbuilder's own headers serve both kinds
                continue
            facts = memo.facts(str(path))
            found |= facts.markers if facts is not None else set()
        stable = any(marker in found for marker in _STABLE_MARKERS)
        classic = any(marker in found for marker in _CLASSIC_MARKERS)
        if stable and classic:
            # Both kinds of include are written, as in ``#if ...`` stable ``#else`` classic ``#endif`` (Hugging
            # Face kernel-builder's registration.h): ask the preprocessor which branch the op's flags take.
            return self._preprocessed_abi() or "classic"
        return "stable" if stable else "classic"

    def _preprocessed_abi(self) -> str | None:
        """"stable" or "classic" from the headers the preprocessor includes under the op's own flags (only
        theirs: a macro opbuilder adds for a stable build cannot decide that the build is stable); None
        when it cannot tell."""
        include_dirs = [str(p) for p in self._include_dirs()]
        found: list[str] = []
        with self._reading_own_flags():
            for source in self.all_sources():
                declared = self.nvcc_args() if source.suffix in CUDA_SUFFIXES else self.cxx_args()
                headers = toolchain.included_headers(str(source), declared, include_dirs)
                if headers is None:
                    return None
                found += headers
        stable = any(marker.decode() in h for h in found for marker in _STABLE_MARKERS)
        classic = any(marker.decode().strip("<") in h for h in found for marker in _CLASSIC_MARKERS)
        return "stable" if stable and not classic else "classic"

    def final_ldflags(self) -> list[str]:
        return self._composed(OpBuilder.extra_ldflags(self), self.extra_ldflags())

    def is_python_module(self) -> bool:
        if self.PYTHON_MODULE is not None:
            return self.PYTHON_MODULE
        return any(b"PYBIND11_MODULE" in facts.markers for p in self.all_sources()
                   if (facts := self._file_memo.facts(str(p))) is not None)

    def _include_dirs(self) -> list[Path]:
        return self._resolve(self.include_paths()) + [INCLUDE_DIR]

    def key_inputs(self) -> dict[str, Any]:
        """Everything the cache key hashes, as a JSON-able dict (kept in the manifest too).

        Worked out once per builder object; a new object sees edited files.
        """
        return self._key_inputs

    @cached_property
    def _key_inputs(self) -> dict[str, Any]:
        with toolchain.one_lookup():
            return self._worked_out_key_inputs()

    def _worked_out_key_inputs(self) -> dict[str, Any]:
        with_cuda = self.with_cuda()
        cxx_args = self.final_cxx_args()
        cxx = toolchain.cxx_path()
        nvcc = toolchain.nvcc_path() if with_cuda else None
        host = toolchain.nvcc_host_path() if with_cuda else None
        inputs = {
            "op": self.name,
            "builder_version": self.VERSION,
            "files": self.file_digests(with_cuda),
            "cxx_args": cxx_args,
            "nvcc_args": self.final_nvcc_args() if with_cuda else [],
            "ldflags": self.final_ldflags(),
            "python_module": self.is_python_module(),
            **toolchain.abi_environment(self.abi() == "stable", self.stable_target() if self.abi() == "stable"
                                        else toolchain.STABLE_ABI_TARGET),
            "cxx": toolchain.compiler_identity(cxx) if cxx else None,
            "nvcc": toolchain.compiler_identity(nvcc) if nvcc else None,
            "nvcc_host": toolchain.compiler_identity(host) if host else None,
            "cuda_home": toolchain.cuda_home() if with_cuda else None,
            "cuda_archs": self.cuda_archs() if with_cuda else [],
            "cpu_isa": toolchain.cpu_isa() if any("native" in a for a in cxx_args) else None,
        }
        # Where the compilers look for headers that no flag names: switching CPATH (``module load``) can
        # swap a header without changing one file the key has read. Only when set, so other keys stay.
        include_vars = env.include_path_variables()
        if include_vars:
            inputs["include_path_variables"] = include_vars
        # Headers the compiler read last time that no include path predicts (``#include MACRO``, CPATH):
        # their contents are part of the key too (see ``opbuilder.jit.compile``).
        extra = fingerprint.discovered_files(self.name)
        if extra:
            inputs["discovered"] = fingerprint.digest_files([Path(p) for p in extra], [], self._file_memo)
        self._file_memo.save()
        return inputs

    @cached_property
    def key(self) -> str:
        return fingerprint.cache_key(self.key_inputs())

    @property
    def namespace(self) -> str:
        return f"opb_{self.name}_{self.key[:12]}"

    def build_spec(self, verbose: bool = False) -> BuildSpec:
        """What ``opbuilder.jit.build`` builds and loads for this op (``verbose``: log why the op cannot
        be built here, or builds only its CPU part, before building)."""
        from opbuilder.jit import build

        inputs = self.key_inputs()
        with_cuda = bool(inputs["nvcc_args"])
        sources = self.built_sources(with_cuda)

        def incompatible() -> list[str]:
            reasons = self.incompatibility_reasons()
            if verbose and not reasons:
                self.is_compatible(verbose=True)  # says which part is built (CPU only, and why)
            return reasons

        def rekey() -> BuildSpec:
            self.refresh(rehash=True)  # a file changed during the build: read every file again
            return self.build_spec(verbose)

        return build.BuildSpec(
            op=self.name,
            key=self.key,
            name=self.name,
            namespace=self.namespace,
            python_module=inputs["python_module"],
            sources=[str(p) for p in sources],
            include_paths=[str(p) for p in self._include_dirs()],
            cxx_args=inputs["cxx_args"],
            nvcc_args=inputs["nvcc_args"] if with_cuda else [],
            ldflags=inputs["ldflags"],
            with_cuda=with_cuda,
            archs=self.cuda_archs() if with_cuda else [],
            inputs=inputs,
            project_files=[str(p) for p in self._project_files(with_cuda)],
            digest_roots=[str(p) for p in self.digest_roots()],
            skipped=self._skipped_sources(with_cuda),
            prebuilt=self.prebuilt_wanted(),
            incompatible=incompatible,
            rekey=rekey,
        )

    def _skipped_sources(self, with_cuda: bool) -> str | None:
        """The CUDA sources a CPU-only build leaves out, and why (said when the library then lacks a symbol)."""
        cuda = [p.name for p in self.all_sources() if p.suffix in CUDA_SUFFIXES]
        if with_cuda or not cuda:
            return None
        return f"{', '.join(cuda)}: {self.cuda_skip_reason()}"

    _CACHED = ("_key_inputs", "key", "_all_sources", "_detected_abi", "_stable_target", "_project_files_of",
               "_file_memo")

    def refresh(self, rehash: bool = False) -> None:
        """Forget the key worked out so far: the next ``key`` stats the files again (and reads those whose
        status changed; ``rehash``: reads every one, whatever the cache's memo says)."""
        for name in self._CACHED:
            self.__dict__.pop(name, None)
        if rehash:
            self.__dict__["_rehash"] = True

    def load(self, verbose: bool = False) -> Any:
        """The op, compiled on first use: a ``torch.ops`` namespace for ``TORCH_LIBRARY`` builds,
        the extension module for ``PYBIND11_MODULE`` builds. Runs ``opbuilder.jit.build.build_and_load``
        on ``build_spec()``.

        A built-in op compiled at install time is used when it was built for this process
        (``opbuilder.jit.prebuilt``); its namespace is then the prebuilt one, not ``self.namespace``.

        Raises IncompatibleOpError, BuildError, CacheLockTimeout or CacheError, each saying why.
        """
        from opbuilder.jit import build

        return build.build_and_load(self.build_spec(verbose))

    # ---- install-time builds (``opbuilder.jit.prebuild``, ``opbuilder.jit.prebuilt``) -------------

    def prebuilt_dir(self) -> Path | None:
        """Where an install-time build of this op would be; None: this op is never prebuilt (only the
        built-in ops' own builders are, ``opbuilder.builders.base.BuiltinBuilder``)."""
        return None

    def prebuilt_requirements(self) -> dict[str, Any]:
        """What a prebuilt library of this op must have been built with to run in this process."""
        from opbuilder.jit import prebuilt

        stable = self.abi() == "stable"
        return prebuilt.requirements(
            op=self.name, version=self.VERSION, python_module=self.is_python_module(), stable=stable,
            stable_target=self.stable_target() if stable else toolchain.STABLE_ABI_TARGET,
            files=self.file_digests(with_cuda=True), cxx_args=self.final_cxx_args(), nvcc_args=self.final_nvcc_args(),
        )

    def prebuilt_key(self) -> str:
        """The key of an install-time build of this op here: names its library and its namespace."""
        archs = self.cuda_archs() if self.with_cuda() else []
        return fingerprint.cache_key({"prebuilt": self.prebuilt_requirements(), "cuda_archs": archs})

    def prebuilt_wanted(self) -> prebuilt.Wanted | None:
        """What an install-time build must match to serve this process; None when there is none to look
        at (a stat: the warm path of an op that is not prebuilt computes nothing more)."""
        folder = self.prebuilt_dir()
        if folder is None or not folder.is_dir():
            return None
        from opbuilder.jit import prebuilt

        with_cuda = self.with_cuda()
        return prebuilt.Wanted(op=self.name, folder=folder, requires=self.prebuilt_requirements(),
                               with_cuda=with_cuda, cuda_archs=tuple(self.cuda_archs()) if with_cuda else ())

    def builder(self) -> Any:
        """A setuptools extension that compiles this op's build spec at install time, into
        ``opbuilder/_prebuilt/<op>/`` (see ``opbuilder.jit.prebuild``): portable (no ``-march``), named by
        the prebuilt key, which hashes what the library must match at load, so its namespace never
        collides with a JIT build's."""
        from opbuilder.jit import build

        return build.extension(self.build_spec(), self.prebuilt_key())
