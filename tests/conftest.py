"""Shared fixtures: one build cache for the whole run (under build/, so a second run is warm), and
helpers to run Python in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# Every test process and every child it starts builds into this cache unless told otherwise.
os.environ.setdefault("OPB_CACHE_DIR", str(ROOT / "build" / "test-cache"))

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run on the GPU machine")


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with this environment plus ``env``."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT
    )


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache root for tests that build from scratch."""
    root = tmp_path / "cache"
    monkeypatch.setenv("OPB_CACHE_DIR", str(root))
    return root
