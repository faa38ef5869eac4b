"""What must hold when things go wrong: killed builds, signals, corrupt, hostile, unwritable or full
caches, upgrades."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, copy_cache, default_sigint, run_python
from helpers import cache as built
from helpers.userop import load_snippet, user_op_key, write_user_op

OK = "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]"
NOBODY = 65534


def _start(op: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", load_snippet(op)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=default_sigint, **popen)


def _lock_is_free(lock_path: Path) -> bool:
    from filelock import FileLock, Timeout

    try:
        with FileLock(str(lock_path), timeout=0):
            return True
    except Timeout:
        return False


@pytest.mark.slow
def test_sigkill_at_ten_random_moments(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    op_dir = fresh_cache / "add_scale"
    # How long one whole load takes here, started as the loads below are (a fresh interpreter: run_python's
    # forked children skip import torch), to spread the kills over compiling, linking and publishing.
    started = time.time()
    probe = _start(op, env=dict(os.environ, OPB_CACHE_DIR=str(tmp_path / "probe-cache")))
    _, err = probe.communicate(timeout=600)
    assert probe.returncode == 0, err
    span = time.time() - started
    rng = random.Random(20261121)
    survived = 0
    for _ in range(10):
        proc = _start(op)
        time.sleep(rng.uniform(0.5, span * 1.1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert built.wait_for(lambda: not built.build_processes(op / "csrc", op_dir), 3), "a compiler outlived its loader"
        for lock in op_dir.glob("*.lock"):
            assert _lock_is_free(lock), f"{lock} still held after its holder was killed"
        # (a kill before the build started leaves no op folder at all)
        for build in [p for p in op_dir.glob("*") if p.is_dir() and not p.name.startswith(".")]:
            assert (build / "manifest.json").is_file(), f"partial build published at {build}"
        survived += 1
    result = built.load(op, OPB_LOCK_TIMEOUT="0")
    assert result.returncode == 0, result.stderr
    assert OK in result.stdout
    assert survived == 10
    assert not list(op_dir.glob(".tmp-*")), "stray temporary folders must be gone after a build"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_every_compiler(sig: signal.Signals, tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    proc = _start(op)
    # ninja and its compilers run in the op's work folder in the cache.
    assert built.wait_for(lambda: bool(built.build_processes(op / "csrc", fresh_cache)), 120), "the build never started"
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert built.wait_for(lambda: not built.build_processes(op / "csrc", fresh_cache), 3), built.build_processes(op / "csrc", fresh_cache)
    result = built.load(op, OPB_LOCK_TIMEOUT="0")
    assert result.returncode == 0 and OK in result.stdout, result.stderr


@pytest.mark.parametrize("damage", ["missing manifest", "garbled manifest", "manifest of another file"])
def test_damaged_manifest_is_rebuilt(damage: str, built_user_op: tuple[Path, Path], fresh_cache: Path) -> None:
    op = built_user_op[0]
    copy_cache(built_user_op[1], fresh_cache)
    build_dir, manifest = built.manifest(fresh_cache)
    if damage == "missing manifest":
        (build_dir / "manifest.json").unlink()
    elif damage == "garbled manifest":
        (build_dir / "manifest.json").write_text('{"artifact": ')
    else:
        manifest["artifact_size"] += 1
        (build_dir / "manifest.json").write_text(json.dumps(manifest))
    result = built.load(op)
    assert result.returncode == 0 and OK in result.stdout, result.stderr
    assert built.builds(result) == 1


def test_stray_temporary_folder_is_ignored_and_removed(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    key = user_op_key(op)
    stray = fresh_cache / "add_scale" / f".tmp-{key}-99999-abc"
    stray.mkdir(parents=True)
    (stray / f"add_scale_{key[:12]}.so").write_bytes(b"not a library")
    result = built.load(op)
    assert result.returncode == 0 and OK in result.stdout, result.stderr
    assert not stray.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")
def test_artifact_owned_by_another_user_is_refused(built_user_op: tuple[Path, Path], fresh_cache: Path) -> None:
    op = built_user_op[0]
    copy_cache(built_user_op[1], fresh_cache)
    build_dir, manifest = built.manifest(fresh_cache)
    os.chown(build_dir / manifest["artifact"], NOBODY, NOBODY)
    refused = built.load(op)
    assert refused.returncode != 0
    assert "owned by another user" in refused.stderr and "OPB_TRUST_SHARED_CACHE=1" in refused.stderr
    trusted = built.load(op, OPB_TRUST_SHARED_CACHE="1")
    assert trusted.returncode == 0 and OK in trusted.stdout, trusted.stderr


def test_folder_writable_by_others_is_refused(built_user_op: tuple[Path, Path], fresh_cache: Path) -> None:
    op = built_user_op[0]
    copy_cache(built_user_op[1], fresh_cache)
    (fresh_cache / "add_scale").chmod(0o777)
    refused = built.load(op)
    assert refused.returncode != 0
    assert "writable by" in refused.stderr and str(fresh_cache / "add_scale") in refused.stderr
    assert built.load(op, OPB_TRUST_SHARED_CACHE="1").returncode == 0


def test_new_cache_root_is_private(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    assert built.load(op).returncode == 0
    assert fresh_cache.stat().st_mode & 0o777 == 0o700
    assert (fresh_cache / "add_scale").stat().st_mode & 0o777 == 0o700


def test_planted_lock_symlink_is_not_followed(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    key = user_op_key(op)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (fresh_cache / "add_scale").mkdir(parents=True, mode=0o700)
    fresh_cache.chmod(0o700)
    (fresh_cache / "add_scale" / f"{key}.lock").symlink_to(victim)
    result = built.load(op)
    assert result.returncode != 0
    assert "symbolic link" in result.stderr
    assert victim.read_text() == "precious"


def test_unusable_cache_root_is_named(tmp_path: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = built.load(op, OPB_CACHE_DIR=str(blocker / "cache"))
    assert result.returncode != 0
    assert "CacheError" in result.stderr and str(blocker / "cache") in result.stderr
    assert "OPB_CACHE_DIR" in result.stderr


def test_full_disk_during_build_is_named_and_leaves_nothing(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    # Files over 64 KiB cannot be written: the object file of the build hits that limit, as on a full disk.
    code = (
        "import resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))\n" + load_snippet(op)
    )
    result = run_python(code)
    assert result.returncode != 0
    assert "CacheError" in result.stderr and "ran out of space" in result.stderr, result.stderr[-3000:]
    assert "OPB_CACHE_DIR" in result.stderr
    leftovers = [p for p in (fresh_cache / "add_scale").iterdir() if p.is_dir()]
    assert leftovers == [], leftovers


def test_torch_upgrade_reuses_a_stable_op(built_user_op: tuple[Path, Path], fresh_cache: Path) -> None:
    op = built_user_op[0]
    copy_cache(built_user_op[1], fresh_cache)
    upgraded = run_python("import torch\ntorch.__version__ = '99.0.0'\n" + load_snippet(op))
    assert upgraded.returncode == 0 and OK in upgraded.stdout, upgraded.stderr
    assert built.builds(upgraded) == 0, "a stable-ABI build serves every torch of its ABI range"


def test_torch_upgrade_gives_a_classic_op_a_new_key_and_both_builds_coexist(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj", classic=True)
    assert built.load(op).returncode == 0
    upgraded = run_python("import torch\ntorch.__version__ = '99.0.0'\n" + load_snippet(op))
    assert upgraded.returncode == 0 and OK in upgraded.stdout, upgraded.stderr
    assert built.builds(upgraded) == 1
    builds = [p for p in (fresh_cache / "add_scale").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(builds) == 2
    versions = {json.loads((b / "manifest.json").read_text())["inputs"]["torch"] for b in builds}
    assert "99.0.0" in versions and len(versions) == 2
    again = built.load(op)
    assert built.builds(again) == 0, "the original build is still there and still used"


def test_a_released_lock_is_free_though_a_forked_child_holds_its_descriptor(tmp_path: Path) -> None:
    """A process forked while a build held its key's lock (a DataLoader worker forked by another thread, no exec)
    keeps a copy of the lock's descriptor: the flock belongs to the open file, so closing the builder's copy left
    the key locked for the child's life, and every other rank waiting on it until OPB_LOCK_TIMEOUT. Release
    unlocks the file itself."""
    from opbuilder.jit.locks import FileLock, Timeout

    path = tmp_path / "key.lock"
    held = FileLock(path, mode=0o600)
    held.acquire()
    child = os.fork()
    if child == 0:  # the forked worker: holds its copies until killed
        time.sleep(60)
        os._exit(0)
    try:
        held.release()
        other = FileLock(path, mode=0o600)  # another open file: conflicts as another rank's would
        try:
            other.acquire(timeout=2)
        except Timeout:
            pytest.fail("the lock stayed held by the forked child's copy of the released descriptor")
        other.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_fifo_in_place_of_a_cache_record_is_not_waited_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest, the failure record and discovered.json were opened as they came: a FIFO planted there (a
    shared cache another user can write to, before the trust checks that would refuse it) hung every rank in
    open(). They are read only as regular files of a bounded size, opened without blocking."""
    import threading

    from opbuilder import paths
    from opbuilder.jit import cache, fingerprint

    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    slot = cache.Slot("add_scale", "k" * 20)
    cache.ensure_dir(slot.path)
    fifos = [slot.path / paths.MANIFEST, slot.failure_path, paths.discovered("add_scale")]
    for fifo in fifos:
        os.mkfifo(fifo)
    results: list[object] = []
    reader = threading.Thread(target=lambda: results.extend([
        cache.read_manifest(slot.path), cache.read_failure(slot), fingerprint.discovered_files("add_scale")]),
        daemon=True)
    reader.start()
    reader.join(10)
    try:
        assert not reader.is_alive(), "a read of a FIFO in the cache blocked"
        assert results == [None, None, []], results
    finally:
        for fifo in fifos:  # a writer's open and close let a blocked reader go
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
