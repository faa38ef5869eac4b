"""Issue 13: what a JIT cache must never do (load code someone else could have planted, load a file
other than the one it checked, build against a runtime that depends on what else was imported), and
the smaller ways the cache, the loader and the toolchain failed under odd but real conditions.

The user op is built once for the module; each test works on its own copy of that cache (copied with
its modification times, so the copy is a warm cache).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_python
from test_cache import _builds, _load, _manifest
from userop import load_snippet, write_user_op

OK = "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the user op's folder, a cache holding its build); tests copy the cache with ``_copy_cache``."""
    base = tmp_path_factory.mktemp("built")
    op = write_user_op(base / "proj")
    cache = base / "cache"
    result = _load(op, OPB_CACHE_DIR=str(cache))
    assert result.returncode == 0 and OK in result.stdout, result.stderr
    return op, cache


def _copy_cache(cache: Path, dest: Path) -> Path:
    shutil.copytree(cache, dest, symlinks=True)  # copy2: mtimes kept, so the manifest still matches
    return dest


# ---- 2. the whole chain is checked, and the checked file is the one loaded ------------------------


def test_root_linking_to_a_folder_writable_by_others_is_refused(built: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built
    target = _copy_cache(cache, tmp_path / "open")
    target.chmod(0o777)
    link = tmp_path / "cache-link"
    link.symlink_to(target)
    refused = _load(op, OPB_CACHE_DIR=str(link))
    assert refused.returncode != 0, refused.stdout
    assert "CacheError" in refused.stderr and "writable by group and others" in refused.stderr, refused.stderr[-2000:]
    assert f"refusing to use {target}:" in refused.stderr


def test_folder_above_the_root_writable_by_group_is_refused(built: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o775)
    root = _copy_cache(cache, team / "cache")
    refused = _load(op, OPB_CACHE_DIR=str(root))
    assert refused.returncode != 0, refused.stdout
    assert "writable by group" in refused.stderr and f"refusing to use {team}:" in refused.stderr, refused.stderr[-2000:]
    team.chmod(0o1777)  # sticky, as /tmp: others can add entries but not move or remove ours
    accepted = _load(op, OPB_CACHE_DIR=str(root))
    assert accepted.returncode == 0 and OK in accepted.stdout, accepted.stderr[-2000:]
    assert _builds(accepted) == 0


def test_symlinked_artifact_is_refused(built: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built
    root = _copy_cache(cache, tmp_path / "cache")
    build_dir, manifest = _manifest(root)
    artifact = build_dir / manifest["artifact"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.rename(artifact, elsewhere / artifact.name)  # same bytes, same mtime: only the link is wrong
    artifact.symlink_to(elsewhere / artifact.name)
    for trust in ("0", "1"):
        refused = _load(op, OPB_CACHE_DIR=str(root), OPB_TRUST_SHARED_CACHE=trust)
        assert refused.returncode != 0, refused.stdout
        assert "symbolic link" in refused.stderr and str(artifact) in refused.stderr, refused.stderr[-2000:]


SWAP_AT_DLOPEN = """
import ctypes, os, sys
from pathlib import Path
import torch
build_dir, planted, moved = Path({build_dir!r}), Path({planted!r}), Path({moved!r})
real_cdll = ctypes.CDLL
class SwapFirst(real_cdll):
    # Swaps the build folder for the planted one just before the op's library is opened.
    def __init__(self, name, *args, **kwargs):
        if name and "add_scale_" in os.path.realpath(name) and not moved.exists():
            os.rename(build_dir, moved)
            os.rename(planted, build_dir)
        super().__init__(name, *args, **kwargs)
ctypes.CDLL = SwapFirst
""" + "{load}" + """
inodes = sorted({{int(ln.split()[4]) for ln in open("/proc/self/maps") if "add_scale_" in ln}})
print("INODES", inodes, moved.exists())
"""


def test_folder_swapped_after_the_check_is_not_loaded(built: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built
    root = _copy_cache(cache, tmp_path / "cache")
    build_dir, manifest = _manifest(root)
    planted = tmp_path / "planted"
    shutil.copytree(build_dir, planted)  # a copy: other inodes, the same checks pass on it
    checked = (build_dir / manifest["artifact"]).stat().st_ino
    swapped_in = (planted / manifest["artifact"]).stat().st_ino
    code = SWAP_AT_DLOPEN.format(build_dir=str(build_dir), planted=str(planted), moved=str(tmp_path / "moved"),
                                 load=load_snippet(op))
    result = run_python(code, env={"OPB_CACHE_DIR": str(root)})
    assert result.returncode == 0 and OK in result.stdout, result.stderr[-2000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("INODES"))
    assert line.endswith("True"), "the folder was never swapped: the test did not test anything"
    assert str(checked) in line and str(swapped_in) not in line, (line, checked, swapped_in)


# ---- 4. the OpenMP runtime is torch's, whatever else the process loaded ---------------------------

FLAGS_AND_KEY = """
import ctypes, json, sys
{before}
import torch
{after}
from opbuilder import registry, toolchain
print("FLAGS", json.dumps({{"flags": toolchain.openmp_flags(), "key": registry.get_builder("relu").key}}))
"""


def _flags_and_key(before: str = "", after: str = "") -> dict:
    result = run_python(FLAGS_AND_KEY.format(before=before, after=after))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(next(ln for ln in result.stdout.splitlines() if ln.startswith("FLAGS "))[len("FLAGS "):])


def test_openmp_runtime_does_not_depend_on_what_was_loaded_first(tmp_path: Path) -> None:
    import torch

    from opbuilder import elf, toolchain

    clean = _flags_and_key()
    if not clean["flags"][0]:
        pytest.skip(f"no OpenMP here (torch: {torch.backends.openmp.is_available()}, compiler: {toolchain.cxx_path()})")
    runtime = Path(clean["flags"][1][0])
    torch_cpu = Path(torch.__file__).resolve().parent / "lib" / "libtorch_cpu.so"
    if torch_cpu.is_file():
        assert runtime.name in elf.dynamic_entries(torch_cpu)["needed"], "not the runtime torch links"
    # Another wheel's bundled copy of the runtime (as scikit-learn ships one), loaded before or after torch.
    bundled = tmp_path / "other.libs" / "libgomp-d22c30c5.so.1.0.0"
    bundled.parent.mkdir()
    shutil.copy2(runtime, bundled)
    load = f"ctypes.CDLL({str(bundled)!r})"
    assert _flags_and_key(before=load) == clean
    assert _flags_and_key(after=load) == clean
