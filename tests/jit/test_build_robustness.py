"""Issue 24 (items 1-3, 8, 9): a build that must not be fooled by clock skew or a CPATH switch, locks that
fail at once where flock cannot work, clear errors for a full or read-only cache and for bad settings,
and op names and project paths that cannot break the cache or the build file.

Builds use the tiny two-file op of tests/twofile.py, each into a fresh cache.
"""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, run_python, twofile
from opbuilder import OpBuilder, env, paths
from opbuilder.jit import cache, compile

X = torch.arange(3, dtype=torch.float32)


def _work_folders(cache_root: Path, op: str) -> list[Path]:
    return sorted(p for p in (cache_root / paths.work_root().name).glob(f"{op}-*") if p.is_dir())


# ---- 1. clock skew: objects dated in the future --------------------------------------------------


DAY = 86400.0


def _step_the_clock_back(monkeypatch: pytest.MonkeyPatch, cache_root: Path, op: str) -> None:
    """What a clock stepped back by a day (or a shared cache written by a host whose clock runs ahead)
    leaves: what the last build wrote is dated later than anything written from now on. Here the op's
    libraries in its work folders (and the times ninja logged for them) move a day ahead, and every
    file the next build's snapshot writes is dated a day back."""
    later = time.time() + DAY
    for work in _work_folders(cache_root, op):
        for library in work.glob("*.so"):
            os.utime(library, (later, later))
        log = work / ".ninja_log"
        lines = log.read_text().splitlines()
        assert lines[0].startswith("# ninja log v"), lines[0]
        shifted = [lines[0]]
        for line in lines[1:]:
            fields = line.split("\t")
            assert len(fields) == 5 and fields[2].isdigit(), line  # start, end, mtime (ns), output, command hash
            if fields[3].endswith(".so"):
                fields[2] = str(int(later * 1e9))
            shifted.append("\t".join(fields))
        log.write_text("\n".join(shifted) + "\n")
    original = compile.write_ninja
    stepped = time.time()

    def write_ninja_after_the_step(spec, work: Path) -> Path:
        target = original(spec, work)
        for folder in (work / paths.WORK_SOURCES, work / paths.WORK_GENERATED):
            for dirpath, _dirs, files in os.walk(folder):
                for name in files:
                    path = os.path.join(dirpath, name)
                    if os.stat(path).st_mtime >= stepped:
                        os.utime(path, (stepped - DAY, stepped - DAY))
        return target

    monkeypatch.setattr(compile, "write_ninja", write_ninja_after_the_step)


def _build_then_run(builder, root: Path, op: str, expected: list[float]) -> None:
    """Build here (under the stepped clock), then load and run in a fresh process: a stale library published
    under the new key cannot load there (its namespace is the old key's), and in this process it would
    register the old namespace a second time."""
    from opbuilder.jit import build

    build.ensure_built(builder.build_spec())
    proc = run_python(twofile.run_snippet(root, op))
    assert f"RESULT {expected}" in proc.stdout, "the old library was published under the new key:\n" + proc.stderr[-2000:]


def test_objects_newer_than_their_edited_sources_are_not_trusted(tmp_path: Path, fresh_cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root = twofile.write_op(tmp_path / "proj", name="skew_edit")
    assert twofile.builder(root).load().skew_edit(X).tolist() == [0, 2, 4]
    _step_the_clock_back(monkeypatch, fresh_cache, "skew_edit")
    twofile.set_kernel(root, "3")
    edited = twofile.builder(root)
    _build_then_run(edited, root, "skew_edit", [0.0, 3.0, 6.0])
    assert cache.read_manifest(cache.Slot("skew_edit", edited.key).path)["compiled"] == ["kernel.cpp"]


def test_a_header_edit_under_clock_skew_recompiles_its_includers(tmp_path: Path, fresh_cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root = twofile.write_op(tmp_path / "proj", name="skew_hdr")
    (root / "csrc" / "value.h").write_text("#pragma once\nconstexpr float kValue = 7;\n")
    twofile.set_kernel(root, "kValue", extra='#include "value.h"')
    assert twofile.builder(root).load().skew_hdr(X).tolist() == [0, 7, 14]
    _step_the_clock_back(monkeypatch, fresh_cache, "skew_hdr")
    (root / "csrc" / "value.h").write_text("#pragma once\nconstexpr float kValue = 8;\n")
    _build_then_run(twofile.builder(root), root, "skew_hdr", [0.0, 8.0, 16.0])


def test_a_header_found_through_cpath_edited_under_clock_skew_recompiles(tmp_path: Path, fresh_cache: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A header outside the snapshot (found through CPATH) is in the object's record too."""
    extra = tmp_path / "extra"
    extra.mkdir()
    header = extra / "skew_value.h"
    header.write_text("#pragma once\nconstexpr float kValue = 3;\n")
    monkeypatch.setenv("CPATH", str(extra))
    root = twofile.write_op(tmp_path / "proj", name="skew_cpath")
    twofile.set_kernel(root, "kValue", extra="#include <skew_value.h>")
    assert twofile.builder(root).load().skew_cpath(X).tolist() == [0, 3, 6]
    _step_the_clock_back(monkeypatch, fresh_cache, "skew_cpath")
    header.write_text("#pragma once\nconstexpr float kValue = 4;\n")
    os.utime(header, (time.time() - DAY, time.time() - DAY))  # written after the step
    _build_then_run(twofile.builder(root), root, "skew_cpath", [0.0, 4.0, 8.0])


@pytest.mark.parametrize("record", ["not json", "[]", '{"kernel.o": "x"}', '{"kernel.o": {"object": 1, "inputs": []}}'])
def test_a_damaged_object_record_recompiles(record: str, tmp_path: Path, fresh_cache: Path) -> None:
    name = f"bad_record_{len(record)}"  # one op per case: a process loads a namespace once
    root = twofile.write_op(tmp_path / "proj", name=name)
    twofile.builder(root).load()
    for work in _work_folders(fresh_cache, name):
        (work / "objects.json").write_text(record)
    twofile.set_kernel(root, "3")
    edited = twofile.builder(root)
    assert getattr(edited.load(), name)(X).tolist() == [0, 3, 6]
    assert sorted(cache.read_manifest(cache.Slot(name, edited.key).path)["compiled"]) == ["binding.cpp", "kernel.cpp"]


def test_unchanged_objects_are_still_reused_after_a_failed_compile(tmp_path: Path, fresh_cache: Path,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """The content records must not cost the incremental build: an object compiled in a build that then
    failed on another file is reused once that file is fixed."""
    from opbuilder.errors import BuildError

    root = twofile.write_op(tmp_path / "proj", name="skew_fail")
    twofile.builder(root).load()
    binding = root / "csrc" / "binding.cpp"
    binding.write_text(binding.read_text() + "\n// edited\n")
    twofile.set_kernel(root, "3 +")  # a syntax error
    with pytest.raises(BuildError):
        twofile.builder(root).load()
    capfd.readouterr()
    twofile.set_kernel(root, "3")
    assert twofile.builder(root).load().skew_fail(X).tolist() == [0, 3, 6]
    assert "(1 of 2 files compiled)" in capfd.readouterr().err


# ---- 2. CPATH and its kin are part of the key ---------------------------------------------------


@pytest.mark.parametrize("variable", ["CPATH", "CPLUS_INCLUDE_PATH"])
def test_switching_the_header_search_path_rebuilds(variable: str, tmp_path: Path, fresh_cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``module load libfoo/2.0`` does: the same header name, found through another folder."""
    versions = {}
    for version, value in (("1.0", "3"), ("2.0", "4")):
        folder = tmp_path / f"libfoo-{version}" / "include"
        folder.mkdir(parents=True)
        (folder / "foo_value.h").write_text(f"#pragma once\nconstexpr float kValue = {value};\n")
        versions[version] = folder
    root = twofile.write_op(tmp_path / "proj", name=f"switch_{variable.lower()}")
    twofile.set_kernel(root, "kValue", extra="#include <foo_value.h>")
    call = f"switch_{variable.lower()}"
    monkeypatch.setenv(variable, str(versions["1.0"]))
    first = twofile.builder(root)
    assert getattr(first.load(), call)(X).tolist() == [0, 3, 6]
    monkeypatch.setenv(variable, str(versions["2.0"]))
    second = twofile.builder(root)
    assert second.key != first.key
    assert getattr(second.load(), call)(X).tolist() == [0, 4, 8], "the build against libfoo 1.0's header was kept"
    monkeypatch.setenv(variable, str(versions["1.0"]))
    assert getattr(twofile.builder(root).load(), call)(X).tolist() == [0, 3, 6]


def test_every_include_path_variable_is_keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = twofile.write_op(tmp_path / "proj", name="switch_keys")
    for name in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH"):
        monkeypatch.delenv(name, raising=False)
    plain = twofile.builder(root).key
    keys = {plain}
    for name in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH"):
        monkeypatch.setenv(name, str(tmp_path))
        keys.add(twofile.builder(root).key)
        monkeypatch.delenv(name)
    assert len(keys) == 4
    assert twofile.builder(root).key == plain


# ---- 9. names and paths --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "my-op", "a/b", "1op", "op name", ".", "opé", "op\n", "x" * 300])
def test_a_bad_name_is_refused_up_front(name: str, fresh_cache: Path) -> None:
    class Bad(OpBuilder):
        NAME = name

        def sources(self) -> list[str]:
            return ["x.cpp"]

    with pytest.raises(ValueError) as info:
        Bad()
    message = str(info.value)
    assert "Bad.NAME" in message and "letters, digits and '_'" in message and repr(name) in message, message
    with pytest.raises(ValueError, match=r"OpBuilder\(name=\.\.\.\) must be letters, digits"):
        OpBuilder(name=name)
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir()), "nothing is created for a refused name"
    assert not (fresh_cache.parent / "escape").exists()


def test_a_project_and_a_cache_in_folders_with_spaces_and_quotes_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "my cache"))
    root = twofile.write_op(tmp_path / "Jo's Kernels" / "proj one", name="spaced")
    (root / "csrc" / "value.h").write_text("#pragma once\nconstexpr float kValue = 6;\n")
    twofile.set_kernel(root, "kValue", extra='#include "value.h"')
    built = twofile.builder(root)
    assert built.load().spaced(X).tolist() == [0, 6, 12]
    manifest = cache.read_manifest(cache.Slot("spaced", built.key).path)
    assert manifest is not None and sorted(manifest["compiled"]) == ["binding.cpp", "kernel.cpp"]
    twofile.set_kernel(root, "(kValue + 1)", extra='#include "value.h"')
    assert twofile.builder(root).load().spaced(X).tolist() == [0, 7, 14]


@pytest.mark.parametrize("where", ["project", "cache"])
@pytest.mark.parametrize("char", ["$", ":"])
def test_a_path_ninja_cannot_hold_is_refused_up_front(where: str, char: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from opbuilder.errors import IncompatibleOpError

    cache_root = tmp_path / (f"ca{char}che" if where == "cache" else "cache")
    monkeypatch.setenv("OPB_CACHE_DIR", str(cache_root))
    root = twofile.write_op(tmp_path / (f"pro{char}ject" if where == "project" else "project"), name="odd_path")
    with pytest.raises(IncompatibleOpError) as info:
        twofile.builder(root).load()
    message = str(info.value)
    assert f"holds {char!r}, which ninja's build file cannot hold" in message, message
    assert ("OPB_CACHE_DIR" in message) == (where == "cache"), message
    assert not list(cache_root.glob("odd_path/*.failed.json")), "a path is not the op's failure"


@pytest.mark.parametrize("where", ["project", "cache"])
def test_a_path_that_is_not_utf8_is_refused_up_front(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder named in Latin-1 (b'caf\\xe9'): cpp_extension writes the build file as UTF-8, and raised
    UnicodeEncodeError from inside torch, naming neither the folder nor OPB_CACHE_DIR."""
    from opbuilder.errors import IncompatibleOpError

    odd = os.fsdecode(b"caf\xe9")
    cache_root = tmp_path / (odd if where == "cache" else "cache")
    monkeypatch.setenv("OPB_CACHE_DIR", str(cache_root))
    root = twofile.write_op(tmp_path / (odd if where == "project" else "project"), name="latin_path")
    with pytest.raises(IncompatibleOpError) as info:
        twofile.builder(root).load()
    message = str(info.value)
    assert "caf\\xe9" in message and "is not valid UTF-8" in message, message
    assert ("OPB_CACHE_DIR" in message) == (where == "cache"), message
    assert not list(cache_root.glob("latin_path/*.failed.json")), "a path is not the op's failure"


# ---- 3. a filesystem without flock fails at once ------------------------------------------------

FAKE_FLOCK = r"""
#include <errno.h>
#include <stdlib.h>
/* flock() as on a filesystem without file locks: it fails with FAKE_FLOCK_ERRNO, every time. */
int flock(int fd, int operation) {
  (void)fd; (void)operation;
  const char* code = getenv("FAKE_FLOCK_ERRNO");
  errno = code ? atoi(code) : ENOSYS;
  return -1;
}
"""


@pytest.fixture(scope="module")
def fake_flock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A library that, preloaded, makes every flock() of a process fail (compiled here, with the C compiler)."""
    folder = tmp_path_factory.mktemp("fake-flock")
    (folder / "fake_flock.c").write_text(FAKE_FLOCK)
    compiler = os.environ.get("CC") or "cc"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "fake_flock.so"), str(folder / "fake_flock.c")],
                   check=True, capture_output=True)
    return folder / "fake_flock.so"


NO_FLOCK = [errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK]


@pytest.mark.parametrize("code", NO_FLOCK, ids=[errno.errorcode[c] for c in NO_FLOCK])
def test_a_build_lock_that_cannot_work_fails_at_once(code: int, fake_flock: Path, tmp_path: Path, fresh_cache: Path) -> None:
    root = twofile.write_op(tmp_path / "proj", name="no_flock")
    proc = run_python(twofile.run_snippet(root, "no_flock"), timeout=120,
                      env={"LD_PRELOAD": str(fake_flock), "FAKE_FLOCK_ERRNO": str(code), "OPB_LOCK_TIMEOUT": "60"})
    assert proc.returncode != 0, proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert "LockUnsupported: opbuilder: cannot lock" in last and errno.errorcode[code] in last, proc.stderr[-3000:]
    assert f"the filesystem of {fresh_cache / 'no_flock'} does not support file locks" in last
    assert "OPB_CACHE_DIR" in last
    assert not [p for p in (fresh_cache / "no_flock").iterdir() if p.is_dir()], "nothing is built or published"


def _run_slot(fake_flock: Path | None, slots: str, timeout: float, code: int = errno.EOPNOTSUPP) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPB_SLOTS": slots, "FAKE_FLOCK_ERRNO": str(code)}
    if fake_flock is not None:
        env["LD_PRELOAD"] = str(fake_flock)
    script = Path(compile.__file__).with_name("_slot.py")
    return subprocess.run([sys.executable, "-I", "-S", str(script), sys.executable, "-c", "print('COMPILED')"],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("code", NO_FLOCK, ids=[errno.errorcode[c] for c in NO_FLOCK])
def test_compile_slots_that_cannot_be_locked_do_not_hang(code: int, fake_flock: Path, tmp_path: Path) -> None:
    proc = _run_slot(fake_flock, f"{tmp_path}:2", timeout=60, code=code)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stderr
    assert str(tmp_path) in proc.stderr and "cannot be locked" in proc.stderr, proc.stderr


def test_a_busy_compile_slot_is_still_waited_for(tmp_path: Path) -> None:
    """Only EWOULDBLOCK means busy: with every slot held, the compiler waits for one."""
    import fcntl

    held = []
    for i in range(2):
        fd = os.open(tmp_path / f"slot.{i}", os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(fd)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            _run_slot(None, f"{tmp_path}:2", timeout=3)
    finally:
        for fd in held:
            os.close(fd)
    proc = _run_slot(None, f"{tmp_path}:2", timeout=60)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout and proc.stderr == "", proc.stderr


def test_clean_and_report_on_a_filesystem_without_flock(fake_flock: Path, tmp_path: Path, fresh_cache: Path) -> None:
    root = twofile.write_op(tmp_path / "proj", name="no_flock_cli")
    assert twofile.builder(root).load().no_flock_cli(X).tolist() == [0, 2, 4]
    env = {**os.environ, "LD_PRELOAD": str(fake_flock), "FAKE_FLOCK_ERRNO": str(errno.EOPNOTSUPP)}
    clean = subprocess.run([sys.executable, "-m", "opbuilder", "clean", "no_flock_cli"], capture_output=True, text=True,
                           env=env, timeout=120, cwd=ROOT)
    assert clean.returncode == 1, clean.stdout + clean.stderr
    assert "Traceback" not in clean.stderr and "does not support file locks" in clean.stderr, clean.stderr
    assert cache.Slot("no_flock_cli", twofile.builder(root).key).path.is_dir(), "nothing was removed unlocked"
    report = subprocess.run([sys.executable, "-m", "opbuilder", "report"], capture_output=True, text=True,
                            env=env, timeout=300, cwd=ROOT)
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr[-2000:]


# ---- 8. clear errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(("variable", "value"), [
    ("OPB_LOCK_TIMEOUT", "nan"), ("OPB_LOCK_TIMEOUT", "inf"), ("OPB_LOCK_TIMEOUT", "-1"),
    ("OPB_MAX_JOBS", "²"), ("OPB_MAX_JOBS", "1" * 20), ("OPB_MAX_JOBS", "0"), ("OPB_MAX_JOBS", "٣"),
])
def test_a_bad_setting_names_its_variable(variable: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, value)
    read = env.lock_timeout if variable == "OPB_LOCK_TIMEOUT" else env.max_jobs
    with pytest.raises(ValueError) as info:
        read()
    assert str(info.value).startswith(f"{variable} must be") and repr(value) in str(info.value), str(info.value)


def test_a_huge_job_count_fails_before_the_build_and_is_not_recorded_against_the_op(
        tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = twofile.write_op(tmp_path / "proj", name="many_jobs")
    monkeypatch.setenv("OPB_MAX_JOBS", "1" * 20)
    with pytest.raises(ValueError, match="OPB_MAX_JOBS must be"):
        twofile.builder(root).load()
    assert not list(fresh_cache.glob("many_jobs/*.failed.json")), "a setting is not the op's failure"


def test_a_failure_record_with_a_null_time_is_reported(fresh_cache: Path) -> None:
    from opbuilder.jit import registry, toolchain
    from opbuilder.tools import report

    builder = registry.get_builder("relu")
    slot = cache.Slot("relu", builder.key)
    slot.op_dir.mkdir(parents=True)
    slot.failure_path.write_text('{"time": null, "pid": 1, "message": "it failed", "log": null}')
    assert cache.read_failure(slot)["time"] is None
    row = report.op_row("relu", toolchain.torch_environment())
    assert row["last_build"] == {"ok": False, "at": None, "seconds": None}
    assert "relu" in report.render(report.collect())


def test_an_empty_sources_list_says_so(fresh_cache: Path) -> None:
    from opbuilder.errors import IncompatibleOpError

    class Empty(OpBuilder):
        NAME = "empty_sources"

        def sources(self) -> list[str]:
            return []

    reasons = Empty().incompatibility_reasons()
    assert reasons == ["Empty.sources() returned no files: list the op's .cpp (and .cu) files, relative to "
                       f"{Path(__file__).resolve().parent}"], reasons
    with pytest.raises(IncompatibleOpError, match=r"sources\(\) returned no files"):
        Empty().load()


from helpers import mounts

FILL_AFTER_LINK = """#!/bin/bash
# The compiler; after the link (the library is written), the cache's filesystem fills up but for
# RESERVE_PAGES pages of 4 KiB.
"{real}" "$@" || exit $?
case " $* " in
  *" -shared "*)
    reserve=$(( ${{RESERVE_PAGES:-0}} * 4096 ))
    [ "$reserve" -gt 0 ] && head -c "$reserve" /dev/zero > "$OPB_CACHE_DIR/reserve"
    dd if=/dev/zero of="$OPB_CACHE_DIR/filler" bs=4k 2>/dev/null
    rm -f "$OPB_CACHE_DIR/reserve"
    ;;
esac
"""

FILL_POINTS = """
import glob, os, shutil, sys, traceback
import torch
sys.path.insert(0, {op!r})
from two_file_ops import TwoFileBuilder
from opbuilder.jit import build
from opbuilder.errors import CacheError
root = {root!r}
for pages in range(0, 18):  # the space left after the link: each write after it fails in turn
    os.environ["RESERVE_PAGES"] = str(pages)
    for library in glob.glob(root + "/.work/*/*.so"):  # so that ninja links (and the disk fills) again
        os.unlink(library)
    for done in glob.glob(root + "/fills_up/*/"):
        shutil.rmtree(done)
    try:
        build.ensure_built(TwoFileBuilder().build_spec())
        outcome = "ok"
    except CacheError as exc:
        outcome = "CacheError " + str(exc)
    except BaseException:
        outcome = "CRASH " + traceback.format_exc().replace(chr(10), " | ")
    os.unlink(root + "/filler")
    left = [p for p in os.listdir(root + "/fills_up") if p.startswith(".tmp-") or os.path.isdir(root + "/fills_up/" + p)]
    print("ATTEMPT", pages, "left", left if outcome != "ok" else [], outcome)
print("RESULT", TwoFileBuilder().load().fills_up(torch.arange(3.0)).tolist())
"""


@mounts.needs_mounts
def test_a_disk_that_fills_while_publishing_is_named_and_leaves_nothing(tmp_path: Path) -> None:
    """The disk fills right after the link, leaving 0, 4, 8, ... KiB: the object records, the copy of the
    library, its log and its manifest each meet the full disk in some attempt."""
    from opbuilder.jit import toolchain

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    op = twofile.write_op(tmp_path / "proj", name="fills_up")
    wrapper = tmp_path / "fill-cxx"
    wrapper.write_text(FILL_AFTER_LINK.format(real=toolchain.cxx_path()))
    wrapper.chmod(0o755)
    setup = f"mount -t tmpfs -o size=8m none {shlex.quote(str(root))}"
    result = mounts.in_mount_namespace(setup, FILL_POINTS.format(op=str(op), root=str(root)),
                                 OPB_CACHE_DIR=str(root), CXX=str(wrapper))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    attempts = [ln for ln in result.stdout.splitlines() if ln.startswith("ATTEMPT")]
    assert len(attempts) == 18, result.stdout
    for line in attempts:
        assert " left [] " in line, line
        assert line.endswith(" ok") or ("CacheError" in line and "ran out of space" in line and "OPB_CACHE_DIR" in line), line
    failed = [ln for ln in attempts if "CacheError" in ln]
    assert any(paths.work_root().name in ln for ln in failed), "the object records met the full disk"
    assert sum(f"{root / 'fills_up'} ran out of space" in ln for ln in failed) >= 2, "the publish steps met it"
    assert attempts[-1].endswith(" ok"), "with enough space left, the build is published"
    assert "RESULT [0.0, 2.0, 4.0]" in result.stdout


# An implementation of relu that leaves a file behind when it runs (imported with --import).
SPY_IMPLEMENTATION = """
from pathlib import Path

import torch
from opbuilder.dispatch import implementations


def spy(x):
    Path({marker!r}).write_text("ran")
    return torch.relu(x)


implementations.register("relu", implementations.python("spy", spy))
"""


@mounts.needs_mounts
@pytest.mark.parametrize("command", ["check", "tune"])
@pytest.mark.parametrize("state", ["full", "read-only", "read-only-traced"])
def test_check_and_tune_on_a_full_or_read_only_cache(command: str, state: str, tmp_path: Path) -> None:
    """Refused before any implementation runs (the rows could not be stored), with the cache's error; also where
    relu's traces folder exists already (an earlier tune's), so that only the probe file is refused."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    quoted = shlex.quote(str(root))
    if state == "full":
        setup = f"mount -t tmpfs -o size=256k none {quoted} && (dd if=/dev/zero of={quoted}/filler bs=4k 2>/dev/null || true)"
    elif state == "read-only-traced":
        (root / "traces" / "relu").mkdir(parents=True)
        setup = f"mount --bind {quoted} {quoted} && mount -o remount,bind,ro {quoted}"
    else:
        setup = f"mount --bind {quoted} {quoted} && mount -o remount,bind,ro {quoted}"
    project, marker = tmp_path / "project", tmp_path / "spy-ran"
    project.mkdir()
    (project / "relu_spy.py").write_text(SPY_IMPLEMENTATION.format(marker=str(marker)))
    args = [command, "relu", "--import", "relu_spy"] + (["--budget-ms", "2"] if command == "tune" else [])
    # what the command left is listed in the mount namespace: the full tmpfs is gone once it ends
    code = (f"import os, sys\nfrom opbuilder.tools.cli import main\nrc = main({args!r})\nroot = {str(root)!r}\n"
            "print('LEFT', sorted(os.path.relpath(os.path.join(d, f), root) for d, ds, fs in os.walk(root) for f in ds + fs))\n"
            "sys.exit(rc)")
    result = mounts.in_mount_namespace(setup + f" && mkdir -p {quoted}/probe 2>/dev/null; true", code, cwd=project,
                                       OPB_CACHE_DIR=str(root))
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    reason = "ran out of space" if state == "full" else "Read-only file system"
    assert last.startswith(f"opbuilder {command}: ") and reason in last and "OPB_CACHE_DIR" in last, last
    left = next(ln for ln in result.stdout.splitlines() if ln.startswith("LEFT "))
    assert ".tmp-" not in left and ".probe-" not in left, left
    # nothing of relu's traces is left, not even an empty folder of them
    assert ("traces/relu" in left) == (state == "read-only-traced"), left
    assert not marker.exists(), f"{command} ran the implementations before finding that the cache cannot be written"
