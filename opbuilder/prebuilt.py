"""Ops compiled at install time, and the choice at load between them and the JIT cache.

``OPB_BUILD_OPS=1 pip install --no-build-isolation .`` runs ``setup.py``, which asks ``plan()`` what to
build, compiles each op through its builder's ``builder()`` and records what it was built for with
``write_manifest()``. The layout inside the installed package mirrors the cache's::

    opbuilder/_prebuilt/<op>/<op>_<key12>.<ext suffix>   the library
    opbuilder/_prebuilt/<op>/manifest.json               its record: torch, CUDA, archs, sources, flags

At load, ``load(builder)`` uses the prebuilt library when its record matches this process: the same
torch build, Python ABI, sources and flags, and CUDA code for every arch this process targets. The
compilers and the CPU model are not compared: the library is built without ``-march=native`` and needs
no compiler to run, which is the point of prebuilding. When it does not match, one line on stderr says
why and the op is built JIT into the cache as usual.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbuilder import cache, env, fingerprint, loader, toolchain
from opbuilder.builder import PREBUILT_DIR

if TYPE_CHECKING:
    from opbuilder.builder import OpBuilder

#: The ``setup.py`` commands that compile; other runs of ``setup.py`` (metadata) stay quiet.
BUILD_COMMANDS = ("build", "build_ext", "bdist_wheel", "install", "develop", "editable_wheel")

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


def say(message: str) -> None:
    print(f"opbuilder: {message}", file=sys.stderr, flush=True)


class PrebuildError(RuntimeError):
    """A prebuild asked for at install time cannot be done; the message says why and what to run."""


# ---- what a prebuilt library must match -------------------------------------------------------


def _portable_cxx(args: list[str]) -> list[str]:
    # -march and OPB_WITH_CUDA follow the machine, not the builder: compared apart (or not at all).
    # -fopenmp follows the compiler found at build time (and there may be none at load): it decides
    # whether parallel_for runs on torch's threads, not what the op computes.
    return [a for a in args if not a.startswith("-march=") and a not in ("-DOPB_WITH_CUDA", "-fopenmp")]


def _portable_nvcc(args: list[str]) -> list[str]:
    # Archs are compared apart; include paths (a CUDA library's headers) follow where it is installed.
    return [a for a in args if not a.startswith(("-gencode", "-I"))]


def requirements(builder: OpBuilder) -> dict[str, Any]:
    """What a prebuilt library of ``builder``'s op must have been built with to run in this process.

    All sources are hashed, CUDA ones included, whether or not this machine has nvcc. Linker flags
    are left out: they say where CUDA libraries were found at build time (and are empty where there
    is no nvcc), while the library loaded at run time is the one torch loads. Runs no compiler and
    writes nothing: a prebuilt op loads where the cache is read-only and no compiler is installed.
    """
    stable = builder.abi() == "stable"
    here = toolchain.abi_environment(stable, builder.stable_target() if stable else toolchain.STABLE_ABI_TARGET)
    return {
        **here,
        "op": builder.name,
        "builder_version": builder.VERSION,
        "python_module": builder.is_python_module(),
        "files": builder.file_digests(with_cuda=True),
        "cxx_args": _portable_cxx(builder.final_cxx_args()),
        # Without CUDA in torch no nvcc flag matters (and torch_cuda already differs).
        "nvcc_args": _portable_nvcc(builder.final_nvcc_args()) if here["torch_cuda"] else [],
    }


def prebuilt_key(builder: OpBuilder) -> str:
    """The key of an install-time build of ``builder`` here: names its library and its namespace."""
    with_cuda = builder.with_cuda()
    return fingerprint.cache_key(
        {"prebuilt": requirements(builder), "cuda_archs": builder.cuda_archs() if with_cuda else []}
    )


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


def mismatch(record: dict[str, Any], builder: OpBuilder) -> str | None:
    """Why a prebuilt library with this record cannot serve ``builder`` here; None when it can."""
    theirs = record.get("requires")
    if not isinstance(theirs, dict):
        return "its record has no 'requires' section (built by another opbuilder version)"
    ours = requirements(builder)
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
        if builder.with_cuda():
            return f"it was built without CUDA, and this machine can build it for CUDA {','.join(builder.cuda_archs())}"
        return None
    wanted = toolchain.cuda_archs()
    missing = uncovered_archs(built_archs, wanted)
    if missing:
        return (
            f"it was built for CUDA archs {','.join(built_archs) or 'none'}, this process needs {','.join(missing)} "
            "(the visible GPUs, or TORCH_CUDA_ARCH_LIST)"
        )
    return None


# ---- finding and loading ----------------------------------------------------------------------


def op_dir(op: str) -> Path:
    return PREBUILT_DIR / op


def is_builtin(builder: OpBuilder) -> bool:
    """Only the registry's own builders can have install-time builds; a user's op of the same name
    is never served one."""
    from opbuilder import registry

    cls = type(builder)
    return registry.BUILDERS.get(builder.name) == f"{cls.__module__}:{cls.__qualname__}"


def find(builder: OpBuilder) -> tuple[Path | None, dict | None, str | None]:
    """(artifact, record, None) when a prebuilt library of this op can be used here;
    (None, record or None, why not) otherwise. ``why`` is None when there is simply none."""
    if not is_builtin(builder):
        return None, None, None
    folder = op_dir(builder.name)
    if not (folder / cache.MANIFEST).is_file():
        return None, None, None
    artifact, record, why = cache.check_build(folder)
    if artifact is None or record is None:
        return None, record, why
    if not isinstance(record.get("key"), str):
        return None, record, "its record has no key"
    # Loading it runs its code: the same rule as for the cache (a package folder others can write to
    # is no safer than a cache folder).
    untrusted = None if env.trust_shared_cache() else cache.chain_problem(artifact)
    if untrusted is not None:
        return None, record, f"{untrusted}, so it could hold someone else's code (OPB_TRUST_SHARED_CACHE=1 accepts it)"
    why = mismatch(record, builder)
    return (None, record, why) if why else (artifact, record, None)


_DECIDED: weakref.WeakKeyDictionary[OpBuilder, Any] = weakref.WeakKeyDictionary()


def load(builder: OpBuilder) -> Any | None:
    """The op's prebuilt library, loaded, when it was built for this process; else None (the caller
    builds JIT), after one line on stderr saying why a prebuilt library was not used."""
    if builder in _DECIDED:
        return _DECIDED[builder]
    artifact, record, why = find(builder)
    handle = None
    if artifact is not None and record is not None:
        try:
            handle = loader.load_artifact(builder.name, record["key"], artifact, record)
        except (OSError, ImportError, AttributeError, RuntimeError) as exc:
            why = f"it failed to load: {exc}"
    if handle is None and why is not None:
        say(f"not using the prebuilt {builder.name} in {op_dir(builder.name)}: {why}; building it JIT instead")
    _DECIDED[builder] = handle
    return handle


# ---- install time ------------------------------------------------------------------------------


def requested() -> tuple[bool, dict[str, bool]]:
    """(OPB_BUILD_OPS, {op: OPB_BUILD_<OP>}) as set in the environment; needs no torch."""
    from opbuilder import registry

    by_var = {f"OPB_BUILD_{name.upper()}": name for name in registry.names()}
    unknown = [var for var in env.build_vars() if var not in by_var]
    if unknown:
        raise PrebuildError(
            f"{', '.join(unknown)} names no built-in op; the variables are "
            + ", ".join(sorted(by_var))
            + " (and OPB_BUILD_OPS=1 for all)"
        )
    return env.build_all_ops(), {by_var[var]: value for var, value in env.build_vars().items()}


def require_torch(wanted: str) -> None:
    """Raise PrebuildError saying what to run when torch cannot be imported (pip's build isolation)."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise PrebuildError(
            f"{wanted} asks to compile ops at install time, but torch cannot be imported here ({exc}). "
            "pip builds in an isolated environment without your torch unless told not to: install torch "
            f"first, then run (from the source folder, or naming the sdist instead of '.')\n"
            f"    {wanted} pip install --no-build-isolation --no-cache-dir .\n"
            "(--no-cache-dir keeps pip from reusing a wheel it built earlier without ops)."
        ) from None


def plan(announce: bool = True) -> list[OpBuilder]:
    """The builders to compile at install time, from OPB_BUILD_OPS / OPB_BUILD_<OP>.

    An op named with OPB_BUILD_<OP>=1 that cannot be built raises PrebuildError with its reason; under
    OPB_BUILD_OPS=1 an op that cannot be built (or whose builder does not import) is skipped with a
    printed reason. Returns [] without importing torch when nothing is asked for.
    """
    from opbuilder import registry

    all_ops, by_op = requested()
    chosen = [op for op in registry.names() if by_op.get(op, all_ops)]
    if not chosen:
        return []
    wanted = "OPB_BUILD_OPS=1" if all_ops else " ".join(f"OPB_BUILD_{op.upper()}=1" for op in chosen)
    require_torch(wanted)
    builders = []
    for op in chosen:
        named = by_op.get(op) is True
        try:
            builder = registry.get_builder(op)
        except Exception as exc:  # a broken builder module is reported, not fatal for the others
            builder, reasons = None, [f"its builder failed to import: {type(exc).__name__}: {exc}"]
        else:
            reasons = builder.incompatibility_reasons()  # a malformed TORCH_CUDA_ARCH_LIST raises here
        if builder is None or reasons:
            if named:
                raise PrebuildError(f"cannot prebuild {op}: " + "; ".join(reasons))
            if announce:
                say(f"skipping {op}: " + "; ".join(reasons))
            continue
        if announce:
            part = "cpu" if not builder.with_cuda() else f"cpu + cuda {','.join(builder.cuda_archs())}"
            extra = "" if builder.with_cuda() else f" (CUDA part skipped: {builder.cuda_skip_reason()})"
            say(f"will prebuild {op} ({part}){extra}")
        builders.append(builder)
    return builders


def write_manifest(builder: OpBuilder, artifact: Path, seconds: float) -> Path:
    """Record beside an install-time build what it was built for; ``mismatch()`` reads it back."""
    with_cuda = builder.with_cuda()
    inputs = builder.key_inputs()
    key = prebuilt_key(builder)
    record = {
        "op": builder.name,
        "key": key,
        "module_name": artifact.name.split(".")[0],
        "namespace": f"opb_{builder.name}_{key[:12]}",
        "python_module": builder.is_python_module(),
        "with_cuda": with_cuda,
        "cuda_archs": builder.cuda_archs() if with_cuda else [],
        "abi": inputs["abi"],
        "torch": toolchain.torch_environment()["torch"],  # what built it; a stable-ABI op serves later ones too
        "torch_cuda": toolchain.torch_environment()["torch_cuda"],
        "compilers": {"cxx": inputs["cxx"], "nvcc": inputs["nvcc"]},
        "ldflags": builder.final_ldflags(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(seconds, 2),
        "requires": requirements(builder),
        **cache.describe_artifact(artifact),
    }
    path = artifact.parent / cache.MANIFEST
    cache.write_text_atomic(path, json.dumps(record, indent=1, sort_keys=True))
    return path


def build_ext_class() -> type:
    """torch's BuildExtension, recording each op's manifest and saying what it prebuilt."""
    BuildExtension = toolchain.cpp_extension().BuildExtension

    class PrebuildExtension(BuildExtension):
        def build_extensions(self) -> None:
            self._opb_done: list[str] = []
            super().build_extensions()
            say(f"prebuilt {len(self._opb_done)} op(s): {', '.join(self._opb_done) or 'none'}")

        def build_extension(self, ext: Any) -> None:
            builder = ext.opb_builder
            say(f"prebuilding {builder.name} ...")
            started = time.time()
            super().build_extension(ext)
            seconds = time.time() - started
            artifact = Path(self.get_ext_fullpath(ext.name))
            write_manifest(builder, artifact, seconds)
            say(f"prebuilt {builder.name} in {seconds:.1f} s: {artifact.name}")
            self._opb_done.append(builder.name)

        def copy_extensions_to_source(self) -> None:
            # An editable install (build_ext --inplace) copies each library into the source tree:
            # make its folder first, and bring its manifest along.
            build_py = self.get_finalized_command("build_py")
            manifests = []
            for ext in self.extensions:
                fullname = self.get_ext_fullname(ext.name)
                built = Path(self.build_lib) / self.get_ext_filename(fullname)
                folder = Path(build_py.get_package_dir(fullname.rpartition(".")[0]))
                folder.mkdir(parents=True, exist_ok=True)
                manifests.append((built.parent / cache.MANIFEST, folder / cache.MANIFEST))
            super().copy_extensions_to_source()
            for built_manifest, inplace_manifest in manifests:
                shutil.copyfile(built_manifest, inplace_manifest)

    return PrebuildExtension


def extensions(builders: list[OpBuilder]) -> list[Any]:
    """The setuptools extensions of ``builders``, each carrying its builder for the manifest."""
    out = []
    for builder in builders:
        ext = builder.builder()
        ext.opb_builder = builder
        out.append(ext)
    return out
