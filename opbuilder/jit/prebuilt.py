"""The choice at load between an op compiled at install time and the JIT cache.

An install-time build (``opbuilder.jit.prebuild``) lives inside the installed package, in a layout that
mirrors the cache's::

    opbuilder/_prebuilt/<op>/<op>_<key12>.<ext suffix>   the library
    opbuilder/_prebuilt/<op>/manifest.json               its record: torch, CUDA, archs, sources, flags

``load(wanted)`` uses the prebuilt library when its record matches this process: the same torch build,
Python ABI, sources and flags, and CUDA code for every arch this process targets. The compilers and the
CPU model are not compared: the library is built without ``-march=native`` and needs no compiler to run,
which is the point of prebuilding. When it does not match, one line on stderr says why and the op is
built JIT into the cache as usual.

Everything here works on what the builder worked out (``Wanted``, made by ``OpBuilder.prebuilt_wanted``);
nothing calls back into the builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opbuilder import env
from opbuilder.jit import cache, loader, toolchain
from opbuilder.jit.log import say

# Fields of the cache key that decide whether a library runs correctly in this process.
_TORCH_FIELDS = ("abi", "torch", "torch_git", "torch_cuda", "cxx11_abi", "python", "soabi")
_LABELS = {
    "abi": "the torch ABI",
    "torch": "torch",
    "torch_git": "torch build (git)",
    "torch_cuda": "torch's CUDA",
    "cxx11_abi": "the C++11 ABI flag",
    "python": "Python",
    "soabi": "the Python ABI",
    "op": "op",
    "builder_version": "builder VERSION",
    "python_module": "python_module",
    "cxx_args": "C++ flags",
    "nvcc_args": "nvcc flags",
}


@dataclass(frozen=True)
class Wanted:
    """What a prebuilt library of one built-in op must match to serve this process."""

    op: str
    folder: Path  # opbuilder/_prebuilt/<op>
    requires: dict[str, Any] = field(hash=False)  # ``requirements(...)`` of the op here
    with_cuda: bool  # whether this machine builds the op's CUDA part
    cuda_archs: tuple[str, ...]  # the archs a build here targets


# ---- what a prebuilt library must match -------------------------------------------------------


def portable_cxx(args: list[str]) -> list[str]:
    # -march and OPB_WITH_CUDA follow the machine, not the builder: compared apart (or not at all).
    # -fopenmp follows the compiler found at build time (and there may be none at load): it decides
    # whether parallel_for runs on torch's threads, not what the op computes.
    return [a for a in args if not a.startswith("-march=") and a not in ("-DOPB_WITH_CUDA", "-fopenmp")]


def portable_nvcc(args: list[str]) -> list[str]:
    # Archs are compared apart; include paths (a CUDA library's headers) follow where it is installed.
    return [a for a in args if not a.startswith(("-gencode", "-I"))]


def requirements(*, op: str, version: str, python_module: bool, stable: bool, stable_target: str,
                 files: dict[str, str], cxx_args: list[str], nvcc_args: list[str]) -> dict[str, Any]:
    """What a prebuilt library of an op must have been built with to run in this process.

    ``stable_target``: the stable ABI's torch version the op is built for (``toolchain.STABLE_ABI_TARGET``
    unless the builder names another). ``files``: the digests of all sources, CUDA ones included, whether or not this machine has nvcc.
    Linker flags are left out: they say where CUDA libraries were found at build time (and are empty
    where there is no nvcc), while the library loaded at run time is the one torch loads. Runs no
    compiler and writes nothing: a prebuilt op loads where the cache is read-only and no compiler is
    installed.
    """
    here = toolchain.abi_environment(stable, stable_target)
    return {
        **here,
        "op": op,
        "builder_version": version,
        "python_module": python_module,
        "files": files,
        "cxx_args": portable_cxx(cxx_args),
        # Without CUDA in torch no nvcc flag matters (and torch_cuda already differs).
        "nvcc_args": portable_nvcc(nvcc_args) if here["torch_cuda"] else [],
    }


def _arch(spec: str) -> tuple[tuple[int, int], bool, bool]:
    """'9.0a+PTX' -> ((9, 0), ptx, arch_specific)."""
    base = spec.removesuffix("+PTX")
    major, _, minor = base.partition(".")
    digits = "".join(c for c in minor if c.isdigit())
    return (int(major), int(digits or 0)), spec.endswith("+PTX"), not minor.isdigit()


def uncovered_archs(built: list[str], wanted: list[str]) -> list[str]:
    """The archs in ``wanted`` that no entry of ``built`` can run on: the same arch, or PTX of an
    older one (which the driver compiles forward; arch-specific PTX such as 9.0a is not portable)."""

    def runs_on(have: str, need: tuple[int, int]) -> bool:
        num, ptx, specific = _arch(have)
        return num == need or (ptx and not specific and num <= need)

    return [want for want in wanted if not any(runs_on(have, _arch(want)[0]) for have in built)]


def mismatch(record: dict[str, Any], wanted: Wanted) -> str | None:
    """Why a prebuilt library with this record cannot serve ``wanted`` here; None when it can."""
    theirs = record.get("requires")
    if not isinstance(theirs, dict):
        return "its record has no 'requires' section (built by another opbuilder version)"
    ours = wanted.requires
    for name in (*(f for f in _TORCH_FIELDS if f in ours), "op", "builder_version", "python_module"):
        if theirs.get(name) != ours[name]:
            return f"it was built for {_LABELS[name]} {theirs.get(name)}, this process has {ours[name]}"
    their_files = theirs.get("files") or {}
    changed = sorted(n for n in set(their_files) | set(ours["files"]) if their_files.get(n) != ours["files"].get(n))
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        return f"its sources differ from the installed ones ({shown})"
    for name in ("cxx_args", "nvcc_args"):
        if theirs.get(name) != ours[name]:
            return f"it was built with other {_LABELS[name]} ({theirs.get(name)} vs {ours[name]} here)"
    built_archs = list(record.get("cuda_archs") or [])
    if not record.get("with_cuda"):
        if wanted.with_cuda:
            return f"it was built without CUDA, and this machine can build it for CUDA {','.join(wanted.cuda_archs)}"
        return None
    missing = uncovered_archs(built_archs, toolchain.cuda_archs())
    if missing:
        return (
            f"it was built for CUDA archs {','.join(built_archs) or 'none'}, this process needs {','.join(missing)} "
            "(the visible GPUs, or TORCH_CUDA_ARCH_LIST)"
        )
    return None


# ---- finding and loading ----------------------------------------------------------------------


def find(wanted: Wanted | None) -> tuple[Path | None, dict | None, str | None]:
    """(artifact, record, None) when a prebuilt library of this op can be used here;
    (None, record or None, why not) otherwise. ``why`` is None when there is simply none."""
    if wanted is None:
        return None, None, None
    if not (wanted.folder / cache.MANIFEST).is_file():
        return None, None, None
    artifact, record, why = cache.check_build(wanted.folder)
    if artifact is None or record is None:
        return None, record, why
    if not isinstance(record.get("key"), str):
        return None, record, "its record has no key"
    # Loading it runs its code: the same rule as for the cache (a package folder others can write to
    # is no safer than a cache folder).
    untrusted = None if env.trust_shared_cache() else cache.chain_problem(artifact)
    if untrusted is not None:
        return None, record, f"{untrusted}, so it could hold someone else's code (OPB_TRUST_SHARED_CACHE=1 accepts it)"
    why = mismatch(record, wanted)
    return (None, record, why) if why else (artifact, record, None)


_DECIDED: dict[Wanted, Any] = {}


def load(wanted: Wanted) -> Any | None:
    """The op's prebuilt library, loaded, when it was built for this process; else None (the caller
    builds JIT), after one line on stderr saying why a prebuilt library was not used."""
    if wanted in _DECIDED:
        return _DECIDED[wanted]
    artifact, record, why = find(wanted)
    handle = None
    if artifact is not None and record is not None:
        try:
            handle = loader.load_artifact(wanted.op, record["key"], artifact, record)
        except (OSError, ImportError, AttributeError, RuntimeError) as exc:
            why = f"it failed to load: {exc}"
    if handle is None and why is not None:
        say(f"not using the prebuilt {wanted.op} in {wanted.folder}: {why}; building it JIT instead")
    _DECIDED[wanted] = handle
    return handle
