"""``run_python``'s and ``run_module``'s forked children (tests/helpers/zygote.py) behave as ``python -c`` and
``python -m`` do: the same exit status, stdout, stderr (tracebacks included), arguments, environment and exit,
checked against a real interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT, zygote

SNIPPETS = {
    "output and status": "import sys; print('out', sys.argv); print('err', file=sys.stderr); sys.exit(3)",
    "exit with a message": "raise SystemExit('stopped: a reason')",
    "an exception": "import torch\ndef f():\n    raise ValueError('boom')\nf()",
    "Ctrl-C": "raise KeyboardInterrupt",
    "a crash": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
    "atexit and a thread": ("import atexit, threading, time\natexit.register(lambda: print('atexit ran'))\n"
                            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()"),
    "environment and folder": "import os; print(os.environ['OPB_PROBE'], os.getcwd(), __name__)",
    "fresh imports": "import sys; print([m for m in sys.modules if m.startswith(('opbuilder', 'helpers'))])",
    "unflushed output": "import sys; sys.stdout.write('no newline')",
}


def _real(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=ROOT)


@pytest.mark.parametrize("name", list(SNIPPETS))
def test_a_forked_child_is_what_python_c_gives(name: str) -> None:
    code = SNIPPETS[name]
    env = dict(os.environ, OPB_PROBE="probe")
    forked = zygote.run(code, env, ROOT, timeout=120)
    assert forked is not None, f"the child was not forked: {zygote.why_not(env)}"
    real = _real(code, env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


@pytest.mark.parametrize("args", [["report", "--json"], ["no-such-command"], ["--help"]],
                         ids=["report", "a bad command", "help"])
def test_a_forked_module_run_is_what_python_m_gives(args: list[str], tmp_path) -> None:
    env = dict(os.environ, OPB_CACHE_DIR=str(tmp_path / "cache"))
    forked = zygote.run_module("opbuilder", args, env, ROOT, timeout=120)
    assert forked is not None, f"the child was not forked: {zygote.why_not(env)}"
    real = subprocess.run([sys.executable, "-m", "opbuilder", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


def test_timeout_kills_the_child_and_raises_as_subprocess_run_does() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run("import time; time.sleep(60)", dict(os.environ), ROOT, timeout=1)


def test_an_environment_torch_reads_at_import_gets_a_real_interpreter() -> None:
    assert zygote.run("print(1)", dict(os.environ, PYTHONPATH="/nowhere"), ROOT, timeout=60) is None
    assert zygote.run("print(1)", dict(os.environ, OMP_NUM_THREADS="1"), ROOT, timeout=60) is None
    assert zygote.forkable(dict(os.environ, OPB_CACHE_DIR="/elsewhere", PATH="/bin"), dict(os.environ))


def test_a_variable_torch_sets_when_cuda_starts_still_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the GPU machine, a test that starts CUDA leaves CUDA_MODULE_LOADING=LAZY in os.environ (torch sets it):
    # every later child of that test process was refused a fork when the rule took the variables it could fork with.
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    forked = zygote.run("import os; print(os.environ['CUDA_MODULE_LOADING'])", dict(os.environ), ROOT, timeout=60)
    assert forked is not None and forked.stdout == "LAZY\n"


def test_the_folders_torch_sets_at_its_first_compile_still_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where TORCHINDUCTOR_CACHE_DIR is not set (CI), the test process's first torch.compile sets it in os.environ
    # (torch's cache_dir()): every later child of that worker was refused a fork, and this file failed on CI.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    before = dict(os.environ)
    cache_dir()
    assert "TORCHINDUCTOR_CACHE_DIR" in os.environ, "torch no longer sets it: this test checks nothing"
    assert zygote.unforkable(dict(os.environ), before) == []
    # The same for what Triton's first compile sets on the GPU machine.
    triton = {"TRITON_CACHE_DIR": "/tmp/t", "TRITON_PTXAS_PATH": "/x/ptxas", "TRITON_LIBDEVICE_PATH": "/x/l.bc"}
    assert zygote.unforkable(dict(before, **triton), before) == []
    assert zygote.unforkable(dict(before, TRITON_HOME="/x"), before) == ["TRITON_HOME"]


def test_no_fork_asked_for_gets_a_real_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert zygote.run("print(1)", dict(os.environ), ROOT, timeout=60) is not None
    monkeypatch.setenv("OPB_TEST_NO_FORK", "1")
    assert zygote.run("print(1)", dict(os.environ), ROOT, timeout=60) is None
