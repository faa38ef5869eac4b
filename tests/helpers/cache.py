"""Reading a test cache: its one build of an op, how many builds a run made, the processes building."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from helpers import run_python
from helpers.userop import load_snippet


def manifest(cache_root: Path, op: str = "add_scale") -> tuple[Path, dict]:
    dirs = [p for p in (cache_root / op).iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(dirs) == 1, f"expected one build of {op}, found {dirs}"
    return dirs[0], json.loads((dirs[0] / "manifest.json").read_text())


def load(root: Path, **env: str) -> subprocess.CompletedProcess:
    return run_python(load_snippet(root), env=env)


def builds(result: subprocess.CompletedProcess) -> int:
    return result.stderr.count("opbuilder: building ")


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def build_processes(source_dir: Path, cache_dir: Path) -> list[str]:
    """Processes compiling ``source_dir`` or running inside ``cache_dir`` (ninja, compilers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if args and (str(source_dir) in args and "-c" in args.split() or cwd.startswith(str(cache_dir))):
            if "pytest" not in args:
                found.append(f"{proc.name}: {args[:200]}")
    return found
