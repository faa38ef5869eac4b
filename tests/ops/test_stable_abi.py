"""Every built-in op is built on the LibTorch stable ABI: its library calls torch only through the C shim
(``aoti_torch_*``, ``torch_*``), never a C++ symbol of c10, ATen or torch, so one binary loads in later
torch versions; and its sources reach no ATen, c10 or classic torch header, directly or through the
headers they include."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from opbuilder.jit import cache, registry, toolchain
from opbuilder.jit.builder import CUDA_SUFFIXES
from opbuilder.paths import INCLUDE_DIR, KERNELS_DIR

OPS = registry.names()
NM = shutil.which("nm")

# A mangled name that names the namespace c10, at or torch anywhere (a function of theirs, or a type of
# theirs in a std:: template's arguments). The length prefixes make "2at" in "12atomic" no match.
TORCH_CXX_SYMBOL = re.compile(r"(?<![0-9])(3c10|2at|5torch)(?=[0-9A-Z])")
# The C shim: plain C names, stable across torch versions.
C_SHIM = re.compile(r"^(aoti_torch_|torch_)")
# Headers a stable-ABI source may reach under torch's include folder.
ALLOWED_TORCH_HEADERS = ("torch/csrc/stable/", "torch/headeronly/", "torch/csrc/inductor/aoti_torch/c/",
                         "torch/csrc/inductor/aoti_torch/generated/c_shim_")
# Include lines no built-in op source may have.
FORBIDDEN_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](ATen/|c10/|torch/library\.h|torch/extension\.h|torch/all\.h|'
                               r'torch/torch\.h|torch/python\.h|opbuilder/binding\.h)', re.MULTILINE)
STABLE_FLAGS = ["-DOPB_STABLE_ABI", "-DTORCH_TARGET_VERSION=0x020a000000000000", "-DOPB_NAMESPACE=opb_check"]


def built_library(op: str) -> Path:
    """The op's shared library, built (CPU part here) and loaded through the builder."""
    builder = registry.get_builder(op)
    builder.load()
    artifact, _, why = cache.check_build(cache.Slot(op, builder.key).path)
    assert artifact is not None, f"{op}: no build in the cache after load(): {why}"
    return artifact


def undefined_symbols(library: Path) -> list[str]:
    out = subprocess.run([NM, "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]


def demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return names
    return subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()


def own_files(op: str) -> list[Path]:
    """The op's sources and every header of kernels/ they include. (opbuilder/include's headers serve
    classic ops too: library.h includes torch/library.h without OPB_STABLE_ABI; the -M test below
    checks what they bring in a stable build.)"""
    builder = registry.get_builder(op)
    todo = list(builder.all_sources())
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', path.read_text(), re.MULTILINE):
            for root in (path.parent, KERNELS_DIR):
                if (root / name).is_file():
                    todo.append((root / name).resolve())
                    break
    return sorted(seen)


def reached_headers(source: Path, extra: list[str]) -> list[str]:
    """Every header the compiler opens for ``source`` with the stable flags (``-M``)."""
    from torch.utils.cpp_extension import include_paths

    cmd = [toolchain.cxx_path(), toolchain.cxx_standard(), "-M", *STABLE_FLAGS, *extra, f"-I{INCLUDE_DIR}",
           f"-I{KERNELS_DIR}", *[f"-I{p}" for p in include_paths()], str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return [p for p in result.stdout.replace("\\\n", " ").split()[1:]]


@pytest.mark.skipif(NM is None, reason="nm (binutils) is not installed")
@pytest.mark.parametrize("op", OPS)
def test_library_uses_only_the_c_shim(op: str) -> None:
    symbols = undefined_symbols(built_library(op))
    cxx = [s for s in symbols if TORCH_CXX_SYMBOL.search(s)]
    assert not cxx, f"{op} calls C++ symbols of torch (not stable across versions): {demangle(cxx)}"
    # The check can fail: every stable op calls the shim, so an empty match means nm read nothing.
    assert any(C_SHIM.match(s) for s in symbols), f"{op}: no C shim symbol among {symbols[:20]}"


@pytest.mark.parametrize("op", OPS)
def test_sources_include_no_classic_torch_header(op: str) -> None:
    files = own_files(op)
    assert any(p.name == "binding.cpp" for p in files)
    bad = {str(p): FORBIDDEN_INCLUDE.findall(p.read_text()) for p in files}
    assert not {p: hits for p, hits in bad.items() if hits}


@pytest.mark.parametrize("op", OPS)
def test_sources_reach_only_stable_torch_headers(op: str) -> None:
    builder = registry.get_builder(op)
    cpp = [p for p in builder.all_sources() if p.suffix not in CUDA_SUFFIXES]
    variants = [[]]
    cuda_home = toolchain.cuda_home()
    if cuda_home and (Path(cuda_home) / "include" / "cuda_runtime_api.h").is_file():
        variants.append(["-DOPB_WITH_CUDA", f"-I{Path(cuda_home) / 'include'}"])
    for source in cpp:
        for extra in variants:
            headers = reached_headers(source, extra)
            torch_headers = [h.split("/include/", 1)[-1] for h in headers if "/torch/include/" in h]
            assert torch_headers, f"{source.name}: -M listed no torch header at all"
            bad = [h for h in torch_headers if not h.startswith(ALLOWED_TORCH_HEADERS)]
            assert not bad, f"{source.name} {' '.join(extra)} reaches classic torch headers: {bad[:10]}"
