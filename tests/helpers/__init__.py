"""What the tests share: the checkout's root, the devices, running Python in a fresh process, copying a cache.

The other modules here are helpers too (never tests): ``reference`` (a float64 reference with per-dtype
tolerances), ``cache`` (reading a cache and its builds), ``userop``/``twofile``/``dispatch_userop`` (small
user ops written on the fly), ``dist_step``/``dist_dtensor`` (scripts run on every rank by torch.distributed.run).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import zygote

ROOT = Path(__file__).resolve().parents[2]
#: This folder: the helper modules and scripts.
HELPERS = Path(__file__).resolve().parent

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run on the GPU machine")


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with this environment plus ``env`` (forked from one that has imported
    torch where that is the same: ``helpers.zygote``)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    forked = zygote.run(code, full_env, ROOT, timeout)
    if forked is not None:
        return forked
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT
    )


def run_module(module: str, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m module *args`` in a fresh interpreter (forked as ``run_python``'s), its output captured; ``env``:
    the whole environment (default: this process's)."""
    full_env = dict(os.environ if env is None else env)
    forked = zygote.run_module(module, list(args), full_env, cwd, timeout)
    if forked is not None:
        return forked
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=cwd)


def default_sigint() -> None:
    """A child's ``preexec_fn``: SIGINT back to its default action. A test run started in the background by a
    non-interactive shell (``cmd &`` in a script) ignores SIGINT, its children inherit that, and a Python
    that starts ignoring SIGINT never raises KeyboardInterrupt: a test that presses Ctrl-C on a child needs
    the child to hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def copy_cache(cache: Path, dest: Path) -> Path:
    """A copy of the cache ``cache`` at ``dest`` (modes and modification times kept, so the manifests still
    match: the copy is a warm cache); returns ``dest``."""
    shutil.copytree(cache, dest, symlinks=True)
    return dest


def torchrun(script: Path, ranks: int, *args: str, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node=ranks script *args`` from the checkout's
    root, its output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def copy_builds(cache: Path, dest: Path, ops: list[str]) -> Path:
    """Copies this checkout's current build of each of ``ops`` (names of folders in the cache: ``relu``,
    ``autograd`` for the C++ gradient glue) from the cache ``cache`` into the cache ``dest`` (made if missing),
    as ``copy_cache`` copies a cache: warm there. Only the build of the op's current key: a developer's cache
    may also hold stale builds (from before a kernel edit), which a test counting builds must not see.
    Returns ``dest``."""
    from opbuilder.builders.autograd import AutogradGlueBuilder
    from opbuilder.jit.registry import get_builder

    for op in ops:
        key = (AutogradGlueBuilder() if op == "autograd" else get_builder(op)).key
        shutil.copytree(cache / op / key, dest / op / key, symlinks=True)
    return dest
