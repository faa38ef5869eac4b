"""Ops compiled at install time.

``OPB_BUILD_OPS=1 pip install --no-build-isolation .`` runs ``setup.py``, which asks ``plan()`` what to
build, compiles each op through its builder's ``builder()`` (a setuptools extension) and records what it
was built for with ``write_manifest()``, into ``opbuilder/_prebuilt/<op>/``. Which library a process
then loads, the prebuilt one or a JIT build, is ``opbuilder.jit.prebuilt``'s choice.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from opbuilder import env
from opbuilder.jit import cache, registry, toolchain
from opbuilder.jit.builder import OpBuilder, default_build_var
from opbuilder.jit.log import say

#: The ``setup.py`` commands that compile; other runs of ``setup.py`` (metadata) stay quiet.
BUILD_COMMANDS = ("build", "build_ext", "bdist_wheel", "install", "develop", "editable_wheel")

class PrebuildError(RuntimeError):
    """A prebuild asked for at install time cannot be done; the message says why and what to run."""


# ---- install time ------------------------------------------------------------------------------


def _build_var(op: str) -> str:
    """The variable that asks for (1) or excludes (0) one op's prebuild: its builder's ``BUILD_VAR``."""
    try:
        return registry.get_builder(op).BUILD_VAR
    except Exception:  # a builder module that does not import: plan() reports it; its variable is the default
        return default_build_var(op)


def requested() -> tuple[bool, dict[str, bool]]:
    """(OPB_BUILD_OPS, {op: its builder's BUILD_VAR}) as set in the environment; needs no torch."""
    by_var = {_build_var(name): name for name in registry.names()}
    unknown = [var for var in env.build_var_names() if var not in by_var]
    if unknown:
        raise PrebuildError(
            f"{', '.join(unknown)} names no built-in op; the variables are "
            + ", ".join(sorted(by_var))
            + " (and OPB_BUILD_OPS=1 for all)"
        )
    chosen = {op: env.build_var(var) for var, op in by_var.items()}
    return env.build_all_ops(), {op: value for op, value in chosen.items() if value is not None}


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
    key = builder.prebuilt_key()
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
        "requires": builder.prebuilt_requirements(),
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
