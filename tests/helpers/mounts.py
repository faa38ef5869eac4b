"""Running a test's Python in a mount namespace of its own (a read-only or full filesystem), where allowed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT


def can_mount() -> bool:
    if os.getuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not can_mount(), reason="needs root and unshare(1) allowed to mount (a private "
                                  "mount namespace makes the read-only or full filesystem)")


def in_mount_namespace(setup: str, code: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python after the shell commands ``setup``, in a mount namespace of its own."""
    script = f"{setup} && exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **env}, timeout=600)
