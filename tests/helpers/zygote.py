"""Child Pythons without their ``import torch``: ``run_python``'s children forked from an interpreter that has
imported torch and nothing of opbuilder (one per test process, started at its first child).

Why: most tests that need a second process (a fresh interpreter, a second rank on one cache, a process that
crashes) spend nearly all of its time in ``import torch``, about 1.4 s of CPU on the 2-core CI machine, in
about 140 children a run. A fork of an interpreter that has done it costs milliseconds.

What a forked child is: ``python -c CODE`` (or ``python -m MODULE ARGS``: ``run_module``, for the ``opbuilder``
command) after ``import torch``, as every test child starts. Its environment,
working folder, arguments (``sys.argv``), stdout and stderr (files the test reads as text, as
``subprocess.run(capture_output=True, text=True)`` gives them), exit status (a signal's as negative), and its
exit (threads joined, ``atexit`` functions run, stdio flushed) are a fresh interpreter's; opbuilder and
everything else the code imports is imported fresh. What it shares with its siblings: torch, imported with the
environment the server started with. So ``forkable`` takes only an environment that differs from the server's
only in variables neither the interpreter's start nor ``import torch`` reads (opbuilder's own, PATH, HOME, CUDA's,
...); one that differs in PYTHONPATH, TORCH_*, OMP_*, ... (``IMPORT_TIME_PREFIXES``), and a call while another is
running in this process, get a real ``subprocess.run``.
"""

from __future__ import annotations

import atexit
import locale
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: Environment variables a forked child must have as the server had them: read by the interpreter's start or by
#: ``import torch`` (and the libraries it loads: OpenMP, MKL). Any other may differ (opbuilder's own, PATH, HOME,
#: CUDA's, which torch reads when CUDA starts, in the child; torch itself sets CUDA_MODULE_LOADING then).
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "LC_", "LANG", "TORCH", "PYTORCH", "TRITON", "OMP_", "GOMP_", "KMP_", "MKL",
                        "OPENBLAS", "NUMPY", "MALLOC", "GLIBC")

#: Variables with those prefixes that torch itself sets in the test process at its first compile (Inductor's
#: and Triton's cache folders, Triton's tools) and reads only when compiling, from the environment of the
#: process compiling: a forked child reads its own. Where CI leaves TORCHINDUCTOR_CACHE_DIR unset, a worker's
#: first ``torch.compile`` sets it, and every later child of that worker was refused a fork.
SET_BY_TORCH_AT_COMPILE = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH",
                                     "TRITON_LIBDEVICE_PATH"})

#: The environment the test process started with (before any test changed it): the server's.
BASE_ENV = dict(os.environ)

_SERVER = r"""
import os, pickle, signal, socket, sys
import torch  # noqa: F401  (what every child would import first)

sock = socket.socket(fileno=int(sys.argv[1]))

def child(request, fds):
    import atexit, random, threading, traceback, types
    sock.close()
    what, env, cwd = request
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    random.seed()
    status = 0
    try:
        if what[0] == "-m":  # python -m MODULE ARGS
            import runpy
            sys.argv[:] = [what[1], *what[2]]
            runpy.run_module(what[1], run_name="__main__", alter_sys=True)
        else:  # python -c CODE
            sys.argv[:] = ["-c"]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(what[1], "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException as exc:
        # The traceback a fresh interpreter prints: from the code's own frames (this function's and runpy's
        # left out).
        tb = exc.__traceback__.tb_next
        while what[0] == "-m" and tb is not None and tb.tb_frame.f_globals.get("__name__") == "runpy":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        status = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if status < 0:  # as Python ends on an uncaught KeyboardInterrupt: by the signal
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(status)

while True:
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    except OSError:
        break
    if not data:
        break
    pid = os.fork()
    if pid == 0:
        child(pickle.loads(data), fds)
    for fd in fds:
        os.close(fd)
    sock.send(pickle.dumps(("started", pid)))
    _, status = os.waitpid(pid, 0)
    sock.send(pickle.dumps(("exited", os.waitstatus_to_exitcode(status))))
"""


class _Server:
    def __init__(self, cwd: Path) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=BASE_ENV, cwd=cwd)
        theirs.close()
        self.sock = ours
        self.busy = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def run(self, what: tuple, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            socket.send_fds(self.sock, [pickle.dumps((what, env, str(cwd)))], [out.fileno(), err.fileno()])
            self.sock.settimeout(60)
            kind, pid = pickle.loads(self.sock.recv(1 << 16))
            assert kind == "started", kind
            self.sock.settimeout(timeout)
            try:
                kind, status = pickle.loads(self.sock.recv(1 << 16))
                timed_out = False
            except socket.timeout:
                os.kill(pid, signal.SIGKILL)
                self.sock.settimeout(60)
                kind, status = pickle.loads(self.sock.recv(1 << 16))
                timed_out = True
            assert kind == "exited", kind
            stdout, stderr = _text(out), _text(err)
        args = [sys.executable, "-c", what[1]] if what[0] == "-c" else [sys.executable, "-m", what[1], *what[2]]
        if timed_out:
            raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(args, status, stdout, stderr)


def _text(f) -> str:
    f.seek(0)
    text = f.read().decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as text=True's universal newlines


_server: _Server | None = None
_start_lock = threading.Lock()


def _get(cwd: Path) -> _Server:
    global _server
    with _start_lock:
        if _server is None or not _server.alive():
            _server = _Server(cwd)
            atexit.register(_server.close)
        return _server


def unforkable(env: dict[str, str], server_env: dict[str, str]) -> list[str]:
    """The variables (sorted) by which a child with environment ``env`` may not be forked from a server started
    with ``server_env``."""
    return sorted(key for key in env.keys() | server_env.keys()
                  if key.startswith(IMPORT_TIME_PREFIXES) and key not in SET_BY_TORCH_AT_COMPILE
                  and env.get(key) != server_env.get(key))


def forkable(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether a child with environment ``env`` may be forked from a server started with ``server_env``."""
    return not unforkable(env, server_env)


def why_not(env: dict[str, str]) -> str:
    """Why ``run`` would not fork a child with environment ``env`` now (for a test's message)."""
    if os.environ.get("OPB_TEST_NO_FORK") == "1":
        return "OPB_TEST_NO_FORK=1"
    if _server is not None and _server.busy.locked():
        return "another call is running"
    keys = unforkable(env, BASE_ENV)
    return f"its environment differs from the server's in {keys}" if keys else "no reason now"


def run(code: str, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess | None:
    """``python -c code`` in a child forked from the server (see the module's docstring); None where it may not
    be (the environment, another call running, ``OPB_TEST_NO_FORK=1``): the caller then starts a real one."""
    return _run(("-c", code), env, cwd, timeout)


def run_module(module: str, args: list[str], env: dict[str, str], cwd: Path,
               timeout: float) -> subprocess.CompletedProcess | None:
    """``python -m module *args`` as ``run`` runs ``python -c``."""
    return _run(("-m", module, list(args)), env, cwd, timeout)


def _run(what: tuple, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess | None:
    if os.environ.get("OPB_TEST_NO_FORK") == "1":
        return None
    server = _get(cwd)
    if not forkable(env, BASE_ENV) or not server.busy.acquire(blocking=False):
        return None
    try:
        return server.run(what, env, cwd, timeout)
    finally:
        server.busy.release()
