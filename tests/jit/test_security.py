"""Issue 13: what a JIT cache must never do (load code someone else could have planted, load a file
other than the one it checked, build against a runtime that depends on what else was imported), and
the smaller ways the cache, the loader and the toolchain failed under odd but real conditions.

The user op is built once for the run (conftest's built_user_op); each test works on its own copy of that
cache (copied with its modification times, so the copy is a warm cache).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import ROOT, copy_cache, run_python
from helpers import cache as built
from helpers import mounts
from helpers.userop import load_snippet, write_user_op

OK = "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]"


# ---- 2. the whole chain is checked, and the checked file is the one loaded ------------------------


def test_root_linking_to_a_folder_writable_by_others_is_refused(built_user_op: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built_user_op
    target = copy_cache(cache, tmp_path / "open")
    target.chmod(0o777)
    link = tmp_path / "cache-link"
    link.symlink_to(target)
    refused = built.load(op, OPB_CACHE_DIR=str(link))
    assert refused.returncode != 0, refused.stdout
    assert "CacheError" in refused.stderr and "writable by group and others" in refused.stderr, refused.stderr[-2000:]
    assert f"refusing to use {target}:" in refused.stderr


def test_folder_above_the_root_writable_by_group_is_refused(built_user_op: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built_user_op
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o775)
    root = copy_cache(cache, team / "cache")
    refused = built.load(op, OPB_CACHE_DIR=str(root))
    assert refused.returncode != 0, refused.stdout
    assert "writable by group" in refused.stderr and f"refusing to use {team}:" in refused.stderr, refused.stderr[-2000:]
    team.chmod(0o1777)  # sticky, as /tmp: others can add entries but not move or remove ours
    accepted = built.load(op, OPB_CACHE_DIR=str(root))
    assert accepted.returncode == 0 and OK in accepted.stdout, accepted.stderr[-2000:]
    assert built.builds(accepted) == 0


def test_symlinked_artifact_is_refused(built_user_op: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built_user_op
    root = copy_cache(cache, tmp_path / "cache")
    build_dir, manifest = built.manifest(root)
    artifact = build_dir / manifest["artifact"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.rename(artifact, elsewhere / artifact.name)  # same bytes, same mtime: only the link is wrong
    artifact.symlink_to(elsewhere / artifact.name)
    for trust in ("0", "1"):
        refused = built.load(op, OPB_CACHE_DIR=str(root), OPB_TRUST_SHARED_CACHE=trust)
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


def test_folder_swapped_after_the_check_is_not_loaded(built_user_op: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built_user_op
    root = copy_cache(cache, tmp_path / "cache")
    build_dir, manifest = built.manifest(root)
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
from opbuilder.jit import registry, toolchain
print("FLAGS", json.dumps({{"flags": toolchain.openmp_flags(), "key": registry.get_builder("relu").key}}))
"""


def _flags_and_key(before: str = "", after: str = "") -> dict:
    result = run_python(FLAGS_AND_KEY.format(before=before, after=after))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(next(ln for ln in result.stdout.splitlines() if ln.startswith("FLAGS "))[len("FLAGS "):])


def test_openmp_runtime_does_not_depend_on_what_was_loaded_first(tmp_path: Path) -> None:
    import torch

    from opbuilder.jit import elf, toolchain

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


# ---- 9. the smaller ones --------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["artifact is a folder", "sizes are strings", "namespace missing"])
def test_manifest_with_wrong_types_is_rebuilt(damage: str, built_user_op: tuple[Path, Path], tmp_path: Path) -> None:
    op, cache = built_user_op
    root = copy_cache(cache, tmp_path / "cache")
    build_dir, manifest = built.manifest(root)
    if damage == "artifact is a folder":
        (build_dir / "sub").mkdir()
        manifest.update(artifact="sub", artifact_size=(build_dir / "sub").stat().st_size)
    elif damage == "sizes are strings":
        manifest.update(artifact_size=str(manifest["artifact_size"]), artifact_mtime_ns=str(manifest["artifact_mtime_ns"]))
    else:
        del manifest["namespace"]
    (build_dir / "manifest.json").write_text(json.dumps(manifest))
    result = built.load(op, OPB_CACHE_DIR=str(root))
    assert result.returncode == 0 and OK in result.stdout, result.stderr[-2000:]
    assert built.builds(result) == 1


FAKE_CCACHE = """#!/bin/sh
# A stand-in for ccache: called as "ccache", its first argument is the compiler (an option is an error);
# called through a link named after a compiler, it runs the next one of that name on PATH.
name=$(basename "$0")
if [ "$name" = ccache ]; then
  case "$1" in
    --version) echo "ccache version 4.8.3"; exit 0 ;;
    -*) echo "ccache: invalid option -- '$1'" >&2; exit 1 ;;
  esac
  exec "$@"
fi
PATH=$(printf %s "$PATH" | sed "s|$(dirname "$0"):||") exec "$name" "$@"
"""

CXX_AND_OPENMP = """
import json
from opbuilder.jit import toolchain
print("CXX", json.dumps({"cxx": toolchain.cxx_path(), "openmp": toolchain.openmp_flags()}))
"""


def _cxx_and_openmp(**env: str) -> dict:
    result = run_python(CXX_AND_OPENMP, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(next(ln for ln in result.stdout.splitlines() if ln.startswith("CXX "))[len("CXX "):])


def test_compiler_behind_a_ccache_link_folder_is_the_real_one(tmp_path: Path) -> None:
    clean = _cxx_and_openmp(OPB_CACHE_DIR=str(tmp_path / "cache-clean"))
    if clean["cxx"] is None:
        pytest.skip("no C++ compiler on PATH")
    launcher = tmp_path / "bin" / "ccache"
    launcher.parent.mkdir()
    launcher.write_text(FAKE_CCACHE)
    launcher.chmod(0o755)
    links = tmp_path / "ccache-links"  # as /usr/lib/ccache: links named after compilers
    links.mkdir()
    for name in ("c++", "g++", "cc", "gcc"):
        (links / name).symlink_to(launcher)
    path = f"{links}{os.pathsep}{os.environ['PATH']}"
    through = _cxx_and_openmp(PATH=path, OPB_CACHE_DIR=str(tmp_path / "cache-ccache"))
    assert through == clean


@mounts.needs_mounts
def test_full_disk_in_cache_writes_is_a_cache_error(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    code = (
        "from pathlib import Path\nfrom opbuilder.jit import cache\nfrom opbuilder.errors import CacheError\n"
        f"root = Path({str(root)!r})\n"
        "for write in (lambda: cache.write_text_atomic(root / 'op' / 'k.failed.json', 'x' * 100000),\n"
        "              lambda: cache.record_failure(cache.Slot('op', 'k'), 'failed', 'log ' * 100000)):\n"
        "    try:\n        write()\n    except CacheError as exc:\n        print('CACHEERROR', exc)\n"
    )
    # A 64 KiB filesystem, filled up before opbuilder writes.
    setup = (f"mount -t tmpfs -o size=64k none {shlex.quote(str(root))} && "
             f"(dd if=/dev/zero of={shlex.quote(str(root / 'filler'))} bs=4k 2>/dev/null || true)")
    result = mounts.in_mount_namespace(setup, code, OPB_CACHE_DIR=str(root))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("CACHEERROR")]
    assert len(lines) == 2, result.stdout
    assert all("ran out of space" in ln and "No space left on device" in ln and "OPB_CACHE_DIR" in ln for ln in lines), lines


@mounts.needs_mounts
def test_read_only_cache_is_named_read_only(built_user_op: tuple[Path, Path], tmp_path: Path) -> None:
    op = shutil.copytree(built_user_op[0], tmp_path / "proj")
    root = copy_cache(built_user_op[1], tmp_path / "cache")
    (op / "csrc" / "scale.h").write_text("#pragma once\nconstexpr float kScale = 3.0;\n")  # a new key: a build is needed
    quoted = shlex.quote(str(root))
    result = mounts.in_mount_namespace(f"mount --bind {quoted} {quoted} && mount -o remount,bind,ro {quoted}",
                                 load_snippet(op), OPB_CACHE_DIR=str(root))
    assert result.returncode != 0, result.stdout
    assert "CacheError" in result.stderr and "Read-only file system" in result.stderr, result.stderr[-2000:]
    assert "Permission denied" not in result.stderr


# ---- 5. a cache shared on purpose serves a second user --------------------------------------------

OTHER_UID = 1001


def _as_other_user(code: str, cwd: Path, umask: int = 0o002, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python as uid/gid OTHER_UID (no other groups), with ``umask``.

    The interpreter, torch and this checkout must be readable by that user. Where they live under
    folders it cannot enter (/root, or a home folder of mode 0700 or 0750 holding the checkout and its
    .venv, at any depth), a mount namespace of the child's own puts an open tmpfs over each such folder,
    shallowest first, and binds back only the entries on the way to what is needed: nothing else of
    it becomes visible, and nothing changes outside the child.
    """
    import torch

    needed = {Path(p).resolve() for p in (sys.base_prefix, sys.prefix, torch.__file__, ROOT, os.path.realpath(sys.executable))}
    setup = []
    closed = sorted({Path(*p.parts[:n]) for p in needed for n in range(2, len(p.parts))
                     if not Path(*p.parts[:n]).stat().st_mode & 0o001}, key=lambda f: len(f.parts))
    stash = 0
    for folder in closed:
        depth = len(folder.parts)
        entries = sorted({Path(*p.parts[:depth + 1]) for p in needed if p.parts[:depth] == folder.parts})
        for i, entry in enumerate(entries):
            make = "touch" if entry.is_file() else "mkdir -p"
            setup.append(f"{make} {cwd}/.mnt{stash + i} && mount --bind {entry} {cwd}/.mnt{stash + i}")
        setup.append(f"mount -t tmpfs -o mode=755 none {folder}")
        for i, entry in enumerate(entries):
            make = "touch" if entry.is_file() else "mkdir -p"
            setup.append(f"{make} {entry} && mount --bind {cwd}/.mnt{stash + i} {entry}")
        stash += len(entries)
    setup.append(f"umask {umask:03o}")
    script = " && ".join(setup) + (f" && exec setpriv --reuid={OTHER_UID} --regid={OTHER_UID} --clear-groups "
                                   f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}")
    full_env = {**os.environ, "HOME": str(cwd), **env}
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd=cwd,
                          env=full_env, timeout=600)


def _can_switch_user() -> bool:
    if not mounts.can_mount() or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "true"])
    return probe.returncode == 0


@pytest.mark.skipif(not _can_switch_user(), reason="needs root, setpriv(1) and unshare(1) allowed to mount: the "
                    "test runs a second, real user id against a cache the first one built")
def test_shared_cache_serves_a_second_user(tmp_path: Path) -> None:
    # Everything the second user touches lives outside pytest's private (0700) temporary folder.
    base = Path(tempfile.mkdtemp(prefix="opb-shared-", dir="/tmp"))
    try:
        base.chmod(0o755)
        op = write_user_op(base / "proj")
        for path in (base / "proj", base / "proj" / "csrc"):
            path.chmod(0o755)
        home = base / "home"
        home.mkdir()
        os.chown(home, OTHER_UID, OTHER_UID)
        shared = base / "cache"  # the team's folder: its group is the second user's, setgid, group-writable
        shared.mkdir()
        os.chown(shared, 0, OTHER_UID)
        shared.chmod(0o2775)
        env = {"OPB_CACHE_DIR": str(shared), "OPB_TRUST_SHARED_CACHE": "1"}

        first = subprocess.run([sys.executable, "-c", load_snippet(op)], capture_output=True, text=True, cwd=base,
                               env={**os.environ, **env}, preexec_fn=lambda: os.umask(0o002), timeout=600)
        assert first.returncode == 0 and OK in first.stdout, first.stderr[-2000:]
        second = _as_other_user(load_snippet(op), home, **env)
        assert second.returncode == 0 and OK in second.stdout, second.stderr[-2000:]
        assert built.builds(second) == 0, "the second user must load the first one's build"

        # A build made under a private umask: the second user is told what to change, not a traceback.
        build_dir, _manifest_ = built.manifest(shared)
        build_dir.chmod(0o700)
        refused = _as_other_user(load_snippet(op), home, **env)
        assert refused.returncode != 0
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith("opbuilder.errors.CacheError:") and str(build_dir) in last, refused.stderr[-2000:]
        assert f"uid {OTHER_UID}" in last and "chmod" in last and "OPB_CACHE_DIR" in last, last
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(not _can_switch_user(), reason="needs root, setpriv(1) and unshare(1) allowed to mount")
@pytest.mark.skipif(ROOT.parent == ROOT.parent.parent, reason="the checkout is at the top of the filesystem")
def test_the_second_user_test_passes_from_a_checkout_in_a_private_folder(tmp_path: Path) -> None:
    """Many home folders are 0700: the test above, run from a checkout inside one, must still pass. In a mount
    namespace of its own, the checkout's folder becomes a private (0700) tmpfs holding only the checkout."""
    parent = shlex.quote(str(ROOT.parent))
    root = shlex.quote(str(ROOT))
    stash = tmp_path / "stash"
    stash.mkdir()
    script = (f"mount --bind {root} {stash} && mount -t tmpfs -o mode=700 none {parent} && mkdir {root} && "
              f"mount --bind {stash} {root} && stat -c %a {parent} && exec {shlex.quote(sys.executable)} -m pytest -q "
              f"-p no:cacheprovider {root}/tests/jit/test_security.py -k test_shared_cache_serves_a_second_user")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd="/",
                            env={k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}, timeout=900)
    assert result.stdout.startswith("700\n"), result.stdout[-2000:] + result.stderr[-2000:]
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


# Writes a trace of one key (its lock first): what a check or tune stores.
WRITE_TRACE = """
from opbuilder.dispatch import trace
row = {"implementation": "x", "device": "cpu", "device_name": trace.device_name("cpu"), "dtype": "float32",
       "status": "PASSED", "bucket": [3, True], "us": 1.0}
print("WROTE", trace.write("shared_trace", {"x": "k"}, [row]))
"""


@pytest.fixture
def shared_trace_folder() -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """A team cache as the README asks (the group's, setgid, made under umask 002) with a trace folder in it: the
    folder, the other user's home and the environment of both users' processes."""
    base = Path(tempfile.mkdtemp(prefix="opb-shared-", dir="/tmp"))
    try:
        base.chmod(0o755)
        home = base / "home"
        home.mkdir()
        os.chown(home, OTHER_UID, OTHER_UID)
        shared = base / "cache"
        shared.mkdir()
        os.chown(shared, 0, OTHER_UID)
        shared.chmod(0o2775)
        folder = shared / "traces" / "shared_trace"
        folder.mkdir(parents=True)
        for path in (folder.parent, folder):
            path.chmod(0o2775)
        yield folder, home, {"OPB_CACHE_DIR": str(shared), "OPB_TRUST_SHARED_CACHE": "1"}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _write_trace_as_root(folder: Path, env: dict[str, str], umask: int) -> Path:
    """The first writer of the trace, under ``umask``; the lock file it made."""
    first = subprocess.run([sys.executable, "-c", WRITE_TRACE], capture_output=True, text=True, cwd=folder.parents[2],
                           env={**os.environ, **env}, preexec_fn=lambda: os.umask(umask), timeout=600)
    assert first.returncode == 0 and "WROTE" in first.stdout, first.stderr[-2000:]
    (lock,) = folder.glob("*.lock")
    return lock


@pytest.mark.skipif(not _can_switch_user(), reason="needs root, setpriv(1) and unshare(1) allowed to mount")
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_lock_made_under_a_narrow_umask_is_still_the_groups_to_take(
        umask: int, shared_trace_folder: tuple[Path, Path, dict[str, str]]) -> None:
    """In a shared cache, a process run once under umask 022 (or 077) made the trace's lock 0644 (0600) in a folder
    the group may write: the lock file stays, and every later write of that key by the group's other users failed
    (PermissionError opening it), though they may replace the trace itself."""
    folder, home, env = shared_trace_folder
    lock = _write_trace_as_root(folder, env, umask)
    second = _as_other_user(WRITE_TRACE, home, **env)
    assert second.returncode == 0 and "WROTE" in second.stdout, second.stderr[-2000:]
    assert lock.stat().st_uid == 0 and lock.stat().st_mode & 0o777 == 0o660 | (0o666 & ~umask), oct(lock.stat().st_mode)


@pytest.mark.skipif(not _can_switch_user(), reason="needs root, setpriv(1) and unshare(1) allowed to mount")
def test_a_lock_file_the_group_may_only_read_is_still_taken(
        shared_trace_folder: tuple[Path, Path, dict[str, str]]) -> None:
    """A lock file left 0644 by another user in a shared cache (an older opbuilder made them so, or another umask):
    the group's other users may replace the trace beside it, yet opening the lock for writing refused them."""
    folder, home, env = shared_trace_folder
    _write_trace_as_root(folder, env, 0o002).chmod(0o644)
    second = _as_other_user(WRITE_TRACE, home, **env)
    assert second.returncode == 0 and "WROTE" in second.stdout, second.stderr[-2000:]


def test_a_read_only_lock_where_flock_needs_writing_names_the_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On NFS flock is a POSIX lock, whose exclusive kind refuses a read-only descriptor (EBADF): the lock file the
    group may only read is then a CacheError naming it, not "locks do not work on this filesystem"."""
    import errno

    from opbuilder.errors import CacheError
    from opbuilder.jit import locks

    path = tmp_path / "k.lock"
    path.touch()
    real_open = os.open

    def open_(file, flags, *args):
        if flags & os.O_RDWR and not flags & os.O_CREAT:  # the file exists: O_CREAT | O_EXCL fails as it should
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, flags, *args)

    def flock(fd, op):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(locks.os, "open", open_)
    monkeypatch.setattr(locks.fcntl, "flock", flock)
    with pytest.raises(CacheError, match=r"k\.lock: Permission denied") as caught:
        locks.FileLock(path).acquire(timeout=1)
    assert not isinstance(caught.value, locks.LockUnsupported), caught.value


def test_a_fifo_planted_as_a_lock_this_user_may_only_read_is_refused(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The read-only way into a lock file must not open a FIFO planted in its place: a read-only open of a FIFO waits
    for a writer, for ever."""
    import errno
    import threading

    from opbuilder.errors import CacheError
    from opbuilder.jit import locks

    path = tmp_path / "k.lock"
    os.mkfifo(path, 0o644)
    real_open = os.open

    def open_(file, flags, *args):
        if flags & os.O_RDWR and not flags & os.O_CREAT:  # as for a user outside the FIFO's owner
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, flags, *args)

    monkeypatch.setattr(locks.os, "open", open_)
    raised: list[BaseException] = []

    def take() -> None:
        try:
            locks.FileLock(path).acquire(timeout=1)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        os.close(real_open(path, os.O_WRONLY | os.O_NONBLOCK))  # lets the stuck open return
        thread.join(10)
        pytest.fail("opening the planted FIFO hung")
    assert len(raised) == 1 and isinstance(raised[0], CacheError), raised
    assert "k.lock" in str(raised[0]), raised[0]


def test_opbuilder_clean_makes_its_locks_as_builds_do(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``opbuilder clean`` takes the lock of each key it removes, making it where there is none: in a shared cache
    it was made 0644 (FileLock's own default), which the group's other users could not open to build that key."""
    from opbuilder.jit import cache
    from opbuilder.tools import cli

    monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", "1")
    slot = cache.Slot("my_user_op", "a" * 20)
    cache.record_failure(slot, "failed", "log")  # a failed build whose lock file was removed since
    before = os.umask(0o002)
    try:
        assert cli.main(["clean", "my_user_op"]) == 0
        made = slot.lock_path.stat().st_mode & 0o777
        assert made == cache.lock_mode() == 0o664, oct(made)
    finally:
        os.umask(before)
    assert not slot.failure_path.exists()
