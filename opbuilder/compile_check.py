"""Does an op compile, CUDA included, on a machine that cannot run it? (CI: no GPU, often a CPU-only torch.)

Every source is compiled to an object file with the exact commands a build runs (``opbuilder.compile``'s
build file), into a temporary folder: nothing is linked, loaded or published in the cache. The CUDA
part is compiled wherever nvcc is found and there are archs to compile for (TORCH_CUDA_ARCH_LIST, or the
archs asked for), also with a torch built without CUDA; where it cannot be, its files are listed as
skipped, with the reason.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from opbuilder import env
from opbuilder.builder import CUDA_SUFFIXES, OpBuilder
from opbuilder.errors import IncompatibleOpError


@dataclass
class CompileCheck:
    """What ``compile_check`` did for one op: files compiled, files that failed (with the compiler's first
    error lines), files skipped (with why), and the CUDA archs the CUDA files were compiled for."""

    op: str
    compiled: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    archs: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


def compile_check(builder: OpBuilder, cuda_archs: list[str] | None = None) -> CompileCheck:
    """Compile every source of ``builder``'s op into a temporary folder; link and load nothing.

    The CUDA sources are compiled for ``cuda_archs`` (default: TORCH_CUDA_ARCH_LIST, else the visible GPUs)
    when nvcc is found, whether or not torch has CUDA; otherwise they are skipped, and ``skipped`` says why.
    Raises IncompatibleOpError when the op cannot be compiled here at all (no C++ compiler, a missing source).
    """
    reasons = builder.incompatibility_reasons()
    has_cuda = any(p.suffix in CUDA_SUFFIXES for p in builder.all_sources())
    result = CompileCheck(builder.name)
    checked = builder
    if has_cuda:
        try:
            checked = builder.for_cuda_check(cuda_archs) if cuda_archs or not builder.with_cuda() else builder
            result.archs = checked.cuda_archs()
            reasons = [r for r in reasons if not r.startswith("the op has only CUDA sources")]
        except IncompatibleOpError as exc:
            why = str(exc).partition("cannot compile its CUDA part here: ")[2] or str(exc)
            result.skipped = {str(p): why for p in builder.all_sources() if p.suffix in CUDA_SUFFIXES}
    if reasons:
        raise IncompatibleOpError(f"op {builder.name!r} cannot be compiled here: " + "; ".join(reasons))
    from opbuilder import compile as ninja_build

    entries = checked.with_current_key(ninja_build.compile_commands)
    with tempfile.TemporaryDirectory(prefix=f"opb-check-{builder.name}-") as out:
        jobs = [(entry["file"], _to_folder(entry["command"], out, i), entry.get("directory")) for i, entry in enumerate(entries)]
        workers = max(1, min(len(jobs), env.max_jobs() or os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            outcomes = list(pool.map(lambda job: _compile(*job), jobs))
    for (source, _cmd, _cwd), error in zip(jobs, outcomes):
        if error is None:
            result.compiled.append(source)
        else:
            result.failed[source] = error
    return result


def _to_folder(command: str, out: str, index: int) -> list[str]:
    """The command's argument list with its object file in ``out``."""
    args = shlex.split(command)
    if "-o" in args:
        at = args.index("-o") + 1
        args[at] = os.path.join(out, f"{index}-{os.path.basename(args[at])}")
    return args


def _compile(source: str, args: list[str], cwd: str | None) -> str | None:
    """None when the compiler succeeded, else its first error lines."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, errors="replace", cwd=cwd or None, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{args[0]}: {exc}"
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).splitlines()
    errors = [ln for ln in lines if "error" in ln.lower()][:6] or lines[-8:]
    return "\n".join(errors)


def describe(check: CompileCheck) -> list[str]:
    """Lines for a person: each file compiled, failed or skipped, and why."""
    lines = []
    for source in check.compiled:
        target = f" (CUDA {','.join(check.archs)})" if Path(source).suffix in CUDA_SUFFIXES else ""
        lines.append(f"{check.op}: compiled {source}{target}")
    for source, error in check.failed.items():
        lines.append(f"{check.op}: FAILED {source}:\n  " + error.replace("\n", "\n  "))
    for source, why in check.skipped.items():
        lines.append(f"{check.op}: skipped {source}: {why}")
    return lines
