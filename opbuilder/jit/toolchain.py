"""What the compilers and the GPU targets are: facts that go into the cache key.

Everything here is cheap on a warm start: compiler versions are memoised per binary (path, size,
mtime) in the cache root, so a warm load never runs a compiler.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from opbuilder import env, paths
from opbuilder.errors import CacheError


#: Compiler launchers installed as a folder of links named after compilers (``/usr/lib/ccache/c++``).
_LAUNCHERS = ("ccache",)


#: Inside ``one_lookup``: (program, PATH) -> what ``which`` found.
_FOUND: dict[tuple[str, tuple[str, ...]], str | None] | None = None


@contextlib.contextmanager
def one_lookup() -> Iterator[None]:
    """Within: ``which`` looks each program up on PATH once (a key is worked out from one view of PATH;
    its flags ask for the C++ compiler about ten times)."""
    global _FOUND
    outer = _FOUND is not None
    if not outer:
        _FOUND = {}
    try:
        yield
    finally:
        if not outer:
            _FOUND = None


def which(program: str) -> str | None:
    """The real path of ``program`` as found on PATH. A compiler found through a ccache link folder is
    the compiler ccache runs (the next one of that name on PATH that is not ccache): that compiler is
    what is probed and keyed; ccache itself answers neither ``--version`` nor ``-fopenmp`` as one."""
    dirs = env.path_dirs()
    found = _FOUND
    if found is None:
        return _which(program, dirs)
    key = (program, tuple(dirs))
    if key not in found:
        found[key] = _which(program, dirs)
    return found[key]


def _which(program: str, dirs: list[str]) -> str | None:
    found = shutil.which(program, path=os.pathsep.join(dirs))
    if not found:
        return None
    real = os.path.realpath(found)
    name = os.path.basename(found)
    if os.path.basename(real) not in _LAUNCHERS or name in _LAUNCHERS:
        return real
    for folder in dirs:
        candidate = shutil.which(name, path=folder)
        if candidate and os.path.basename(os.path.realpath(candidate)) not in _LAUNCHERS:
            return os.path.realpath(candidate)
    return None  # ccache would find no compiler either


@functools.lru_cache(maxsize=None)
def _cuda_home_cached(hint: str | None, nvcc_on_path: str | None) -> str | None:
    if hint:
        return hint
    # nvcc on PATH may be a wrapper script outside the toolkit: accept its grandparent only when
    # it looks like a toolkit.
    if nvcc_on_path and (Path(nvcc_on_path).parent.parent / "include" / "cuda_runtime.h").is_file():
        return str(Path(nvcc_on_path).parent.parent)
    return "/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else None


def cuda_home() -> str | None:
    """The CUDA toolkit root, found the way torch.utils.cpp_extension finds it."""
    return _cuda_home_cached(env.cuda_home_hint(), which("nvcc"))


class _DropMessage:
    """A logging filter that drops records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def filter(self, record: object) -> bool:
        return not str(getattr(record, "msg", "")).startswith(self.prefix)


def cpp_extension(cuda: bool = False) -> ModuleType:
    """``torch.utils.cpp_extension``, imported without the line it logs when torch has CUDA but no GPU is
    visible ("No CUDA runtime is found, using CUDA_HOME=..."): opbuilder says itself what it builds and why.

    For a build with CUDA (``cuda``), its toolkit is the one this module found and the key names: where
    cpp_extension guessed another from an ``nvcc`` on PATH that is a wrapper outside the toolkit, it is
    pointed at ours. Raises BuildError when CUDA_HOME was set to another toolkit when it was imported.
    """
    import logging
    import sys

    if "torch.utils.cpp_extension" not in sys.modules:
        quiet = _DropMessage("No CUDA runtime is found")
        logger = logging.getLogger("torch.utils.cpp_extension")
        logger.addFilter(quiet)
        try:
            from torch.utils import cpp_extension as cpp
        finally:
            logger.removeFilter(quiet)
    from torch.utils import cpp_extension as cpp

    home = cuda_home() if cuda else None
    if home and (cpp.CUDA_HOME is None or os.path.realpath(cpp.CUDA_HOME) != os.path.realpath(home)):
        if env.cuda_home_hint() is None:  # its own guess (from PATH, or none: a torch without CUDA)
            cpp.CUDA_HOME = home
        else:
            from opbuilder.errors import BuildError

            raise BuildError(
                f"opbuilder: torch.utils.cpp_extension uses the CUDA toolkit {cpp.CUDA_HOME} (found when it was "
                f"imported) but opbuilder keyed this build for {home}; set CUDA_HOME before "
                "importing torch.utils.cpp_extension"
            )
    return cpp


def nvcc_path() -> str | None:
    """The nvcc torch.utils.cpp_extension runs: PYTORCH_NVCC when set, else <CUDA home>/bin/nvcc."""
    override = env.pytorch_nvcc()
    if override is not None:
        return which(override) if not os.path.isabs(override) else (override if os.path.isfile(override) else None)
    home = cuda_home()
    if home is None:
        return None
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None


def torch_cuda_version() -> str | None:
    import torch

    return torch.version.cuda


def _version_memo_path() -> Path:
    return paths.compilers()


def compiler_identity(path: str) -> dict[str, object]:
    """Path, size, mtime, ``--version`` line (and for a C++ compiler, whether it links the C++
    runtime statically) of a compiler binary.

    Asked once per binary and remembered in the cache root (and in this process); later calls only stat.
    """
    st = os.stat(path)
    ident = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    record = _IDENTITIES.get(ident)
    if record is None:
        record = _IDENTITIES[ident] = _identity_record(path, ident)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, **record}


_IDENTITIES: dict[str, dict] = {}


def _identity_record(path: str, ident: str) -> dict:
    memo_path = _version_memo_path()
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    memo = memo if isinstance(memo, dict) else {}
    record = memo.get(ident)
    cxx = "nvcc" not in os.path.basename(path)
    if isinstance(record, dict) and (not cxx or ("openmp" in record and "include_dirs" in record)):
        return record
    if not isinstance(record, dict):
        record = {"version": _ask(path, ["--version"], last=not cxx)}
        if cxx:
            # A bare name back means the compiler has no shared C++ runtime to link.
            record["static_libstdcxx"] = "/" not in _ask(path, ["-print-file-name=libstdc++.so"])
    if cxx:  # also completes a record remembered before these questions were asked
        record["openmp"] = _compiles_openmp(path)
        record["include_dirs"] = _search_dirs(path)
    memo[ident] = record
    _write_memo(memo_path, memo)
    return record


def _compiles_openmp(path: str) -> bool:
    """Whether ``path -fopenmp`` finds ``omp.h`` (a compiler built without its OpenMP runtime does not)."""
    try:
        out = subprocess.run([path, "-fopenmp", "-x", "c++", "-E", "-o", os.devnull, "-"], input="#include <omp.h>\n",
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0


def _search_dirs(path: str) -> list[str]:
    """The folders ``path`` searches for ``#include <...>`` by itself (its own and the system's)."""
    # Without the variables that add folders of the user's (those are keyed by content).
    clean = {k: v for k, v in os.environ.items() if k not in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")}
    try:
        out = subprocess.run([path, "-x", "c++", "-E", "-v", "-o", os.devnull, "-"], input="",
                             capture_output=True, text=True, timeout=60, env=clean)
    except (OSError, subprocess.SubprocessError):
        return []
    lines = out.stderr.splitlines()
    try:
        start = lines.index("#include <...> search starts here:") + 1
        end = lines.index("End of search list.", start)
    except ValueError:
        return []
    dirs = [os.path.realpath(ln.strip().removesuffix(" (framework directory)")) for ln in lines[start:end]]
    # /usr/local/include holds what an administrator installed, not the compiler's: keyed by content.
    return [d for d in dirs if d != "/usr/local/include"]


def compiler_search_dirs() -> list[str]:
    """Where the C++ compiler and nvcc's host compiler find their own headers: their versions are in
    the key, so these folders are covered by version, not by content."""
    dirs: list[str] = []
    for compiler in (cxx_path(), nvcc_host_path() or which("gcc")):
        if compiler:
            dirs += compiler_identity(compiler).get("include_dirs", [])
    return list(dict.fromkeys(dirs))


def _ask(path: str, args: list[str], last: bool = False) -> str:
    """One line of a compiler's answer to ``args`` (the first, or the last), or "unknown"."""
    try:
        out = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [ln for ln in (out.stdout or out.stderr).splitlines() if ln.strip()]
    if not lines:
        return "unknown"
    return lines[-1] if last else lines[0]


#: Options of an op's own flags that change what the preprocessor includes.
_PREPROCESSOR_OPTIONS = ("-D", "-U", "-I", "-std=", "-include", "-isystem", "-iquote")


def included_headers(source: str, flags: list[str], include_dirs: list[str]) -> list[str] | None:
    """The headers ``source`` includes as the preprocessor sees them (``#if`` branches taken by ``flags``'
    macros), without reading torch's or CUDA's headers: those are not on the include path here, so they
    appear by the name they were included with (``torch/library.h``). A ``.cu`` file is read as nvcc's
    host pass reads it. None when the C++ compiler is missing or cannot read the file."""
    cxx = cxx_path()
    if cxx is None:
        return None
    kept: list[str] = []
    for i, flag in enumerate(flags):
        if flag.startswith(_PREPROCESSOR_OPTIONS):
            kept.append(flag)
            if flag in ("-D", "-U", "-I", "-include", "-isystem", "-iquote") and i + 1 < len(flags):
                kept.append(flags[i + 1])
    cuda = ["-x", "c++", "-D__CUDACC__", "-D__NVCC__"] if source.endswith(".cu") else []
    cmd = [cxx, *cuda, *kept, *(f"-I{d}" for d in include_dirs), "-M", "-MG", source]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    deps = out.stdout.replace("\\\n", " ").partition(":")[2].split()
    return [d for d in deps if d != "\\" and d != source]


def libstdcxx_ldflags() -> list[str]:
    """Link flags that make an op use the shared C++ runtime torch itself uses.

    Some toolchains (seen: a g++ under /opt/gcc on the GPU image) ship only ``libstdc++.a``, so an
    op links its own static copy of the C++ runtime, whose locale is never set up: formatting a
    number in an error message then crashes the process. Such a compiler gets the system's
    ``libstdc++.so.6`` named explicitly, ahead of the static library.
    """
    cxx = cxx_path()
    if cxx is None:
        return []
    identity = compiler_identity(cxx)
    if not identity.get("static_libstdcxx"):
        return []
    return ["-Wl,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--as-needed"]


def openmp_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags that let ``at::parallel_for`` in an op's CPU code use torch's threads.

    With torch built on OpenMP, ``at::parallel_for`` is inline code that runs its range in parallel
    only when the op itself is compiled with ``-fopenmp``; without it, every chunk runs on the calling
    thread. The op links the OpenMP runtime torch's own library links, by its path: same soname, so
    the loader hands the op that one runtime and its thread pool (``torch.set_num_threads`` applies).
    Found from torch's files, never from what this process has loaded (another wheel's bundled
    libgomp must not change the flags, hence the key). Linux only, and only with a compiler that has
    OpenMP; else ([], []) and the op's loops run on one thread.
    """
    if platform.system() != "Linux":
        return [], []
    cxx = cxx_path()
    if cxx is None or not compiler_identity(cxx).get("openmp"):
        return [], []
    runtime = torch_openmp_runtime()
    return (["-fopenmp"], [runtime]) if runtime else ([], [])


_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp.", "libomp-")


@functools.lru_cache(maxsize=None)
def torch_openmp_runtime() -> str | None:
    """The path of the OpenMP runtime (libgomp, libiomp5 or libomp) torch's CPU library links, as the
    dynamic loader finds it for that library (its RUNPATH with $ORIGIN, LD_LIBRARY_PATH, the system
    folders); None when torch has no OpenMP or the file cannot be found."""
    import torch

    if not torch.backends.openmp.is_available():
        return None
    from opbuilder.jit import elf

    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch.so"):
        library = lib_dir / name
        try:
            needed = elf.dynamic_entries(library)["needed"]
        except OSError:
            continue
        for dependency in needed:
            if dependency.startswith(_OPENMP_RUNTIMES):
                found = elf.resolve_needed(library, dependency, env.ld_library_path())
                return str(found) if found else None
    return None


def _write_memo(memo_path: Path, memo: dict) -> None:
    from opbuilder.jit import cache  # the cache module owns how files are written under the root

    try:
        cache.write_text_atomic(memo_path, json.dumps(memo, indent=1, sort_keys=True))
    except (OSError, CacheError):
        pass  # a memo is an optimisation: a read-only cache still loads (prebuilt ops), a build says why


class CudaLibrary:
    """Where a CUDA library's header and shared object are."""

    __slots__ = ("include_dir", "lib_dir", "lib_name")

    def __init__(self, include_dir: Path, lib_dir: Path, lib_name: str) -> None:
        # lib_name: "libcublasLt.so", or a versioned "libcublasLt.so.13" (pip wheels ship no unversioned one)
        self.include_dir, self.lib_dir, self.lib_name = include_dir, lib_dir, lib_name

    def ldflags(self) -> list[str]:
        stem = self.lib_name.removeprefix("lib").partition(".so")[0]
        link = f"-l{stem}" if self.lib_name.endswith(".so") else f"-l:{self.lib_name}"
        # The rpath finds the library when torch has not loaded it already.
        return [f"-L{self.lib_dir}", link, f"-Wl,-rpath,{self.lib_dir}"]


def _cuda_library_roots() -> list[Path]:
    # The nvidia-* wheels beside torch first: they hold the libraries torch itself loads.
    roots: list[Path] = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        roots += sorted(p for p in Path(base).iterdir() if (p / "include").is_dir())
        roots += sorted(p for p in Path(base).glob("cu*") if (p / "include").is_dir())
    home = cuda_home()
    if home:
        roots += [Path(home)] + sorted(Path(home).glob("targets/*"))
    return roots


@functools.lru_cache(maxsize=None)
def cuda_header_dir(header: str) -> Path | None:
    """The folder holding a CUDA library's ``header`` (``cusparse.h``), from the nvidia wheels or the toolkit."""
    return next((root / "include" for root in _cuda_library_roots() if (root / "include" / header).is_file()), None)


@functools.lru_cache(maxsize=None)
def find_cuda_library(name: str) -> CudaLibrary | None:
    """A CUDA library (``name`` as in ``cublasLt``: header ``cublasLt.h``, ``libcublasLt.so*``), from
    the nvidia wheels or the CUDA toolkit; None when absent."""
    for root in _cuda_library_roots():
        if not (root / "include" / f"{name}.h").is_file():
            continue
        for lib_dir in (root / "lib", root / "lib64"):
            libs = sorted(lib_dir.glob(f"lib{name}.so*"), key=lambda p: len(p.name))
            if libs:
                return CudaLibrary(root / "include", lib_dir, libs[0].name)
    return None


#: The oldest torch a stable-ABI op runs on: its binary serves this version and every later one.
STABLE_ABI_TARGET = (2, 10)
#: The C++ standard of a stable-ABI build: the ABI target's (torch 2.10 builds with C++17), whatever
#: torch is installed, so that a torch upgrade (2.13 moved to C++20) does not change the build's key.
STABLE_CXX_STANDARD = "-std=c++17"


def stable_abi_flags(target: tuple[int, int] = STABLE_ABI_TARGET) -> list[str]:
    """Flags of a stable-ABI build: the headers expose only what torch ``target`` already had."""
    return ["-DOPB_STABLE_ABI", target_version_flag(target)]


def target_version_flag(target: tuple[int, int]) -> str:
    major, minor = target
    return f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000"


def stable_cxx_standard(target: tuple[int, int] = STABLE_ABI_TARGET) -> str:
    """The C++ standard of a stable-ABI build for torch ``target`` and later: that torch's own
    (C++17 up to 2.12, C++20 from 2.13 on), whatever torch is installed."""
    return "-std=c++20" if target >= (2, 13) else STABLE_CXX_STANDARD


_TARGET_DEFINE = "-DTORCH_TARGET_VERSION="
_TARGET_NAMED = re.compile(r"TORCH_VERSION_(\d+)_(\d+)_\d+")


def declared_target(flags: list[str]) -> tuple[int, int] | None:
    """The stable API a user's own ``-DTORCH_TARGET_VERSION=...`` asks for (the last one wins, as in the
    compiler), as (major, minor); None when the flags set none. Raises ValueError on a value that is not
    torch's encoding (``0x020c000000000000``, or a name such as ``TORCH_VERSION_2_12_0``)."""
    value = None
    for flag in flags:
        if flag.startswith(_TARGET_DEFINE):
            value = flag[len(_TARGET_DEFINE):].strip()
        elif flag in ("-DTORCH_TARGET_VERSION", "-UTORCH_TARGET_VERSION"):
            value = None if flag.startswith("-U") else ""
    if value is None:
        return None
    named = _TARGET_NAMED.fullmatch(value)
    if named:
        return int(named.group(1)), int(named.group(2))
    try:
        number = int(value.removesuffix("ULL").removesuffix("ull"), 0)
    except ValueError:
        number = 0
    if number >> 56 <= 0:
        raise ValueError(
            f"-DTORCH_TARGET_VERSION: expected torch's encoding of a version, e.g. "
            f"{target_version_flag((2, 12))} or {_TARGET_DEFINE}TORCH_VERSION_2_12_0 for torch 2.12, got {value!r}"
        )
    return (number >> 56) & 0xFF, (number >> 48) & 0xFF


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor)."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return major, minor


def abi_environment(stable: bool, target: tuple[int, int] = STABLE_ABI_TARGET) -> dict[str, object]:
    """What a build's binary depends on in torch and Python.

    A classic op (ATen, ``torch/library.h``, pybind11) depends on the exact torch build and Python ABI.
    A stable-ABI op calls only torch's stable C shim and no Python API: it depends on the ABI target
    (torch 2.10 unless the op asks for a later one) and on torch's CUDA major version (the CUDA runtime
    it shares with torch), so a torch upgrade within the range reuses it.
    """
    if not stable:
        return {"abi": "classic", **torch_environment()}
    import torch

    cuda = torch.version.cuda
    return {"abi": "stable-{}.{}".format(*target), "torch_cuda": cuda.split(".")[0] if cuda else None}


def torch_environment() -> dict[str, object]:
    """The torch and Python facts a build depends on, as the cache key and prebuilt records hold them."""
    import importlib.machinery
    import sys

    import torch

    return {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "torch_cuda": torch.version.cuda,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.implementation.cache_tag,
        "soabi": importlib.machinery.EXTENSION_SUFFIXES[0],
    }


@functools.lru_cache(maxsize=None)
def cxx_standard() -> str:
    """The C++ standard torch's headers need: C++20 from torch 2.13 on, C++17 before."""
    return "-std=c++20" if torch_version() >= (2, 13) else "-std=c++17"


def cxx_path() -> str | None:
    return which(env.cxx_compiler())


def nvcc_host_path() -> str | None:
    """nvcc's host compiler when CC names one (cpp_extension passes it as -ccbin), else None."""
    cc = env.nvcc_host_compiler()
    return which(cc) if cc else None


def parse_arch_list(spec: str) -> list[str]:
    """'8.0;9.0+PTX' or '8.0 9.0a' -> ['8.0', '9.0+PTX'] (named arches such as 'Hopper' are refused)."""
    archs = []
    for item in spec.replace(",", ";").replace(" ", ";").split(";"):
        item = item.strip()
        if not item:
            continue
        base = item.removesuffix("+PTX")
        major, _, minor = base.partition(".")
        if not (major.isdigit() and minor and (minor.isdigit() or minor[:-1].isdigit())):
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST: expected entries like '9.0' or '8.6+PTX', got {item!r} in {spec!r}"
            )
        archs.append(item)
    return sorted(set(archs))


@functools.lru_cache(maxsize=None)
def _visible_gpu_archs() -> tuple[str, ...]:
    import torch

    if not torch.cuda.is_available():
        return ()
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return tuple(sorted(f"{major}.{minor}" for major, minor in caps))


def cuda_archs_from_env() -> list[str]:
    """TORCH_CUDA_ARCH_LIST's archs, or [] when it is unset."""
    spec = env.cuda_arch_list()
    return parse_arch_list(spec) if spec is not None else []


def cuda_archs() -> list[str]:
    """Target archs: TORCH_CUDA_ARCH_LIST, else the visible GPUs (this initialises CUDA)."""
    spec = env.cuda_arch_list()
    if spec is not None:
        return parse_arch_list(spec)
    return list(_visible_gpu_archs())


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for arch in archs:
        ptx = arch.endswith("+PTX")
        num = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


@functools.lru_cache(maxsize=None)
def cpu_isa() -> str:
    """The host's ISA flags, which decide what -march=native produces."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.partition(":")[2].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()
