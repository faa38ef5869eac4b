"""The background build of the C++ gradient glue (opbuilder/torchop/cxx_autograd.py): what a process, its forks and
its warnings see while the glue builds, with stand-in build processes (the real build: test_cxx_autograd.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers import ROOT, run_module
from opbuilder.errors import BuildError, FallbackWarning
from opbuilder.torchop import cxx_autograd


def _interpreter(code: str, *args: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter of its own (not a zygote's fork: these run their exit and their forks as a
    user's process does), this environment, from the checkout."""
    return subprocess.run([sys.executable, *flags, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., subprocess.Popen]]:
    """This process's glue state, restored after the test; ``stand_in(code, log)`` makes a build process running
    ``code`` (its output after ``log``) the one this process waits for."""
    for name in ("_state", "_build", "_build_log", "_next_poll", "_namespace"):
        monkeypatch.setattr(cxx_autograd, name, getattr(cxx_autograd, name))
    started: list[subprocess.Popen] = []
    logs: list = []

    def start(code: str, log: str = "") -> subprocess.Popen:
        out = tempfile.TemporaryFile()
        logs.append(out)
        out.write(log.encode())
        out.flush()
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
        started.append(proc)
        monkeypatch.setattr(cxx_autograd, "_build", proc)
        monkeypatch.setattr(cxx_autograd, "_build_log", out)
        monkeypatch.setattr(cxx_autograd, "_state", "building")
        monkeypatch.setattr(cxx_autograd, "_next_poll", 0.0)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for out in logs:
        out.close()


def test_a_killed_build_is_named_as_killed(stand_in) -> None:
    proc = stand_in("import time; time.sleep(60)", log="opbuilder: building autograd (cpu): first build here\n")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with pytest.warns(FallbackWarning, match=r"the process building its C\+\+ glue was killed \(SIGKILL\)"):
        assert cxx_autograd.load(wait=False) is False
    assert cxx_autograd.state() == "off" and cxx_autograd._build_log is None  # its log closed


def test_a_failed_build_says_the_compilers_error_and_where_its_log_is(stand_in) -> None:
    exc = BuildError("opbuilder: building op 'autograd' failed:\n  glue.cpp:80:1: error: 'this' does not name a type\n"
                     "   80 | this is not C++;\nfull log: /cache/autograd/k.failed.log")
    line = cxx_autograd._one_line(exc)
    assert line == ("BuildError: opbuilder: building op 'autograd' failed: glue.cpp:80:1: error: 'this' does not name "
                    "a type (full log: /cache/autograd/k.failed.log)")
    marked = cxx_autograd._ERROR_PREFIX + line
    stand_in(f"print('opbuilder: building autograd (cpu): first build here'); print({marked!r}); print('x');"
             " raise SystemExit(1)").wait()
    with pytest.warns(FallbackWarning) as got:
        cxx_autograd.load(wait=False)
    assert len(got) == 1 and str(got[0].message).endswith("building its C++ glue failed: " + line), got[0].message


def test_asking_about_a_running_build_between_polls_makes_nothing(stand_in, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in("import time; time.sleep(60)")
    monkeypatch.setattr(cxx_autograd, "_next_poll", time.monotonic() + 600)
    made: list[int] = []
    monkeypatch.setattr(cxx_autograd, "_builder", lambda: made.append(1))
    for _ in range(100):  # every call that records a gradient while the glue builds asks
        assert cxx_autograd.load(wait=False) is False
    assert made == [] and cxx_autograd.state() == "building"


def test_the_build_process_imports_this_processs_opbuilder_and_is_reaped(stand_in, fresh_cache: Path,
                                                                        monkeypatch) -> None:
    seen: dict = {}  # (stand_in: this process's glue state saved, restored after)
    real = subprocess.Popen

    def popen(args: list[str], **kwargs) -> subprocess.Popen:
        seen["args"], seen["env"] = args, kwargs["env"]
        return real([sys.executable, "-c", "pass"], stdout=kwargs["stdout"], stderr=kwargs["stderr"])

    monkeypatch.setattr(subprocess, "Popen", popen)
    cxx_autograd._start_build("k" * 64)
    assert seen["args"][1:] == ["-c", cxx_autograd._CHILD, "k" * 64]
    assert seen["env"]["PYTHONPATH"].split(os.pathsep) == cxx_autograd._child_path()
    deadline = time.monotonic() + 30
    while cxx_autograd._build.returncode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cxx_autograd._build.returncode == 0  # waited for by its thread: no zombie until the next gradient
    cxx_autograd._build_log.close()


def test_the_build_process_path_is_this_processs_made_absolute(tmp_path: Path, monkeypatch) -> None:
    import opbuilder

    home = os.path.dirname(os.path.dirname(os.path.abspath(opbuilder.__file__)))
    monkeypatch.chdir(tmp_path)
    # '' and relative entries (python -c, a REPL, Jupyter in a checkout): the working folder as it is now
    monkeypatch.setattr(sys, "path", ["", "rel", *sys.path])
    assert cxx_autograd._child_path()[:2] == [str(tmp_path), str(tmp_path / "rel")]
    # an entry holding another opbuilder before the one imported here: this one's folder goes first
    other = tmp_path / "other"
    (other / "opbuilder").mkdir(parents=True)
    (other / "opbuilder" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", ["", str(other), *sys.path])
    assert cxx_autograd._child_path()[:3] == [home, str(tmp_path), str(other)]


def test_the_build_process_path_without_this_opbuilders_folder_or_working_folder(tmp_path: Path, monkeypatch) -> None:
    import opbuilder

    home = os.path.dirname(os.path.dirname(os.path.abspath(opbuilder.__file__)))
    # the folder this opbuilder came from is on no entry (an import hook, or '' after a chdir): it goes last, where
    # it still comes before any import hook
    monkeypatch.setattr(sys, "path", [str(tmp_path / "a")])
    assert cxx_autograd._child_path() == [str(tmp_path / "a"), home]
    # the working folder removed: '' is left out (abspath('') raises), the rest kept
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    monkeypatch.setattr(sys, "path", ["", "rel", str(tmp_path / "a")])
    assert cxx_autograd._child_path() == [str(tmp_path / "a"), home]
    # an entry whose absolute form holds the path separator cannot travel in PYTHONPATH
    odd = tmp_path / f"x{os.pathsep}y"
    odd.mkdir()
    monkeypatch.chdir(odd)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path / "a")])
    assert cxx_autograd._child_path() == [str(tmp_path / "a"), home]


_DISABLED_FORK = """
import os, subprocess, sys
from opbuilder.torchop import cxx_autograd as ca
ca._build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
ca._state, ca._next_poll = "building", 0.0
with ca.disabled():  # a test or a benchmark comparing the two paths forks inside
    pid = os.fork()
if pid == 0:
    ca.load(wait=False, build=False)
    print("fork", ca.state(), ca._build is None, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("parent", ca.state(), flush=True)
ca._build.kill()
"""


def test_a_fork_inside_disabled_does_not_wait_for_its_parents_build(fresh_cache: Path) -> None:
    result = _interpreter(_DISABLED_FORK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fork new True" in result.stdout and "parent building" in result.stdout, result.stdout


_CHILD_RUN = """
import os, subprocess, sys
from opbuilder.torchop import cxx_autograd as ca
code = ca._CHILD.replace("runpy.run_module('opbuilder.torchop.cxx_autograd', run_name='__main__')",
                         "import opbuilder; print(repr(sys.path[0]), opbuilder.__file__)")
print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=sys.argv[1],
                     env={"PYTHONPATH": os.pathsep.join(ca._child_path())}).stdout)
"""


def test_the_build_process_does_not_put_its_working_folder_first(tmp_path: Path) -> None:
    (tmp_path / "opbuilder").mkdir()
    (tmp_path / "opbuilder" / "__init__.py").write_text("")  # another opbuilder where the child starts
    result = _interpreter(_CHILD_RUN, str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "''" not in result.stdout and str(tmp_path) not in result.stdout, result.stdout
    assert result.stdout.strip().endswith(os.path.join("opbuilder", "__init__.py")), result.stdout


def test_the_build_process_refuses_to_build_another_glue() -> None:
    result = run_module("opbuilder.torchop.cxx_autograd", "0" * 64)
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert result.stdout.startswith(cxx_autograd._ERROR_PREFIX) and "is not the one asked for" in result.stdout


_FORK = """
import os, subprocess, sys, warnings
from opbuilder.torchop import cxx_autograd as ca
ca._build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
ca._state, ca._next_poll = "building", 0.0
pid = os.fork()
if pid == 0:  # a fork worker: the build process is not its child
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ca.load(wait=False, build=False)
    print("fork", ca.state(), len(got), flush=True)
    sys.exit(0)  # a normal exit: its atexit hooks and the freeing of the parent's build process, without a warning
os.waitpid(pid, 0)
print("parent", ca.state(), flush=True)
ca._build.kill()
"""


def test_a_fork_during_the_build_looks_for_the_glue_itself(fresh_cache: Path) -> None:
    result = _interpreter(_FORK, flags=("-W", "default"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fork new 0" in result.stdout and "parent building" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "ResourceWarning" not in result.stderr, result.stderr[-2000:]


_AT_EXIT = """
import subprocess, sys
from opbuilder.torchop import cxx_autograd as ca
real = subprocess.Popen
subprocess.Popen = lambda args, **kw: real([sys.executable, "-c", "import time; time.sleep(5)"], stdout=kw["stdout"],
                                           stderr=kw["stderr"])
ca._start_build("k")
print("started", ca.state())
"""


def test_a_build_still_running_at_exit_warns_nothing(fresh_cache: Path) -> None:
    result = _interpreter(_AT_EXIT, flags=("-W", "default"))
    assert result.returncode == 0 and "started building" in result.stdout, result.stderr[-2000:]
    assert "ResourceWarning" not in result.stderr, result.stderr[-2000:]


def test_a_build_by_another_process_is_waited_for_not_started_again(stand_in, fresh_cache: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks of a torchrun job reach their first gradient at once: where another process holds the glue's
    build lock, no build child is started (each rank started one, a Python with torch that only waited on the
    lock); calls look in the cache, and start a build only once that one has ended without the glue."""
    from opbuilder.jit import cache
    from opbuilder.jit.locks import FileLock

    from opbuilder.jit import loader

    monkeypatch.setattr(cxx_autograd, "_state", "new")
    monkeypatch.setattr(loader, "load_cached", lambda name, key: (None, None))  # not in the cache (nor loaded here)
    started: list[str] = []
    monkeypatch.setattr(cxx_autograd, "_start_build", started.append)
    builder = cxx_autograd._builder()
    other = FileLock(cache.Slot(builder.name, builder.key).lock_path)
    other.acquire()  # another process's build (another open file: flock tells the two apart in one process too)
    try:
        assert cxx_autograd.load(wait=False) is False
        assert cxx_autograd.state() == "waiting" and started == []
        for _ in range(3):
            monkeypatch.setattr(cxx_autograd, "_next_poll", 0.0)
            assert cxx_autograd.load(wait=False) is False
        assert cxx_autograd.state() == "waiting" and started == []
    finally:
        other.release()
    monkeypatch.setattr(cxx_autograd, "_next_poll", 0.0)
    assert cxx_autograd.load(wait=False) is False  # that build ended, and no glue in the cache: this one builds
    assert started == [builder.key]


def test_the_build_child_holds_the_starter_lock_until_it_exits(stand_in, fresh_cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks reach their first gradient within a second, before a build child has imported torch and taken the
    build lock: the process that starts the build takes the starter lock and hands it to its child (no copy kept),
    so the next one waits instead of starting another."""
    from opbuilder import paths
    from opbuilder.jit.locks import FileLock, Timeout

    monkeypatch.setattr(cxx_autograd, "_CHILD", "import time; time.sleep(60)")  # a build that takes its time
    key = cxx_autograd._builder().key
    cxx_autograd._start_build(key)
    child = cxx_autograd._build
    probe = FileLock(paths.build_starter("autograd", key))
    try:
        assert cxx_autograd.state() == "building"
        with pytest.raises(Timeout):
            probe.acquire(timeout=0)
        monkeypatch.setattr(cxx_autograd, "_state", "new")  # as another process at its first gradient
        cxx_autograd._start_build(key)
        assert cxx_autograd.state() == "waiting" and cxx_autograd._build is child
    finally:
        child.kill()
        child.wait()
    probe.acquire(timeout=0)  # gone with the child: this process kept no copy of it
    probe.release()


_WAITING_RANK = """
import sys, time, torch
from opbuilder import ops
from opbuilder.torchop import cxx_autograd
layer = ops.FusedLinearReLU(8, 8)
x = torch.randn(4, 8)
layer(x).sum().backward()
print("first", cxx_autograd.state(), flush=True)
deadline = time.monotonic() + 120
while cxx_autograd.state() == "waiting" and time.monotonic() < deadline:
    time.sleep(0.05)
    layer(x).sum().backward()
print("then", cxx_autograd.state(), type(layer(x).grad_fn).__name__, flush=True)
"""


def test_a_rank_waiting_for_another_ranks_glue_loads_it_when_it_is_there(tmp_path: Path, cxx_autograd_glue: Path) -> None:
    """End to end: a process whose glue another process is building (its lock held here) waits, starts no build,
    and takes the C++ path once the glue is in the cache."""
    from helpers import copy_builds
    from opbuilder.builders.autograd import AutogradGlueBuilder
    from opbuilder.jit.locks import FileLock

    import opbuilder

    node = tmp_path / "cache"
    opbuilder.prepare(["fused_matmul_add_relu"])  # in the run's cache (usually built there already)
    copy_builds(cxx_autograd_glue, node, ["fused_matmul_add_relu"])
    glue = AutogradGlueBuilder()
    other = FileLock(node / glue.name / f"{glue.key}.lock")  # paths.lock under that cache
    other.acquire()
    env = {**os.environ, "OPB_CACHE_DIR": str(node), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _WAITING_RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)
    try:
        first = proc.stdout.readline()
        assert first.strip() == "first waiting", (first, proc.stderr.read()[-3000:] if proc.poll() is not None else "")
        copy_builds(cxx_autograd_glue, node, ["autograd"])  # the other process's build, published
    finally:
        other.release()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert out.startswith("then ready") and "Eager_" not in out, out
    assert "building autograd" not in err and "Python path" not in err, err[-3000:]


def _wait_for_another_build(monkeypatch: pytest.MonkeyPatch, during: Callable[[], None]) -> list[str]:
    """This process at its first gradient while another process builds the glue (its build lock held here);
    ``during`` runs while that build runs, which then ends without the glue. Returns the builds this process
    started."""
    from opbuilder.jit import cache, loader
    from opbuilder.jit.locks import FileLock

    monkeypatch.setattr(cxx_autograd, "_state", "new")
    monkeypatch.setattr(cxx_autograd, "_waiting_since", 0.0)
    monkeypatch.setattr(loader, "load_cached", lambda name, key: (None, None))
    started: list[str] = []
    monkeypatch.setattr(cxx_autograd, "_start_build", started.append)
    builder = cxx_autograd._builder()
    other = FileLock(cache.Slot(builder.name, builder.key).lock_path)
    other.acquire()
    try:
        assert cxx_autograd.load(wait=False) is False and cxx_autograd.state() == "waiting"
        during()
    finally:
        other.release()
    monkeypatch.setattr(cxx_autograd, "_next_poll", 0.0)
    assert cxx_autograd.load(wait=False) is False
    return started


def test_a_build_that_failed_while_this_process_waited_is_not_built_again(stand_in, fresh_cache: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The build the ranks waited for failed (its failure recorded): each rank ends on the Python path with one
    warning saying why, in milliseconds, rather than each building it again (and failing) one after the other."""
    from opbuilder.jit import cache

    builder = cxx_autograd._builder()
    message = "opbuilder: building op 'autograd' failed:\n  glue.cpp:1:1: error: induced"
    fail = lambda: cache.record_failure(cache.Slot(builder.name, builder.key), message, "the log")  # noqa: E731
    with pytest.warns(FallbackWarning) as got:
        started = _wait_for_another_build(monkeypatch, fail)
    assert started == [] and cxx_autograd.state() == "off"
    assert len(got) == 1 and "glue.cpp:1:1: error: induced" in str(got[0].message), [str(w.message) for w in got]


def test_a_failure_recorded_before_this_process_waited_does_not_stop_its_build(stand_in, fresh_cache: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure recorded before the wait is not the awaited build's (that one was killed, or the sources changed
    since): this process builds it."""
    from opbuilder.jit import cache

    builder = cxx_autograd._builder()
    cache.record_failure(cache.Slot(builder.name, builder.key), "opbuilder: an earlier failure", "")
    time.sleep(0.01)  # the wait starts after it (time.time() has a coarse clock on some systems)
    assert _wait_for_another_build(monkeypatch, lambda: None) == [builder.key]
    assert cxx_autograd.state() == "waiting"


_FORK_AT_START = """
import os, signal, subprocess, sys
from opbuilder import paths
from opbuilder.jit.locks import FileLock, Timeout
from opbuilder.torchop import cxx_autograd as ca
key = ca._builder().key
real, workers = subprocess.Popen, []
def popen(args, **kw):  # another thread forks a worker (a DataLoader's, for the whole run) while the build starts
    if args[-1] != key:
        return real(args, **kw)  # the toolchain's probes
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    workers.append(pid)
    return real([sys.executable, "-c", "pass"], **kw)  # a build that ends at once, without the glue
ca.subprocess.Popen = popen
ca._start_build(key)
ca._build.wait()
probe = FileLock(paths.build_starter("autograd", key))
try:
    probe.acquire(timeout=0)
    print("free", flush=True)
except Timeout:
    print("held", flush=True)
os.kill(workers[0], signal.SIGKILL)
os.waitpid(workers[0], 0)
"""


def test_a_worker_forked_while_the_build_starts_does_not_hold_its_starter_lock(fresh_cache: Path) -> None:
    """A process forked between the taking of the starter lock and its handing to the build child got a copy of
    it, and held it for its life: once that build had ended without the glue, the other ranks waited for it for
    ever (on the Python path, without a warning)."""
    result = _interpreter(_FORK_AT_START)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "free", result.stdout + result.stderr[-2000:]
