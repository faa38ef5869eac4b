"""Shared fixtures: one build cache for the whole run (under build/, so a second run is warm), a fresh
cache, a built user op; and how the tests are spread over pytest-xdist workers. What the tests share
besides fixtures is the ``helpers`` package beside this file (no test imports another test module)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Under xdist, each worker's torch.compile would start its own pool of one compiler process per core: with
# 16 workers, hundreds of processes on 16 cores, and CPU tests waited minutes for Inductor's compiles (GPU
# run, faulthandler at 150 s). One compile thread per worker: the workers are the parallelism.
# Also, Inductor (torch 2.11) checks each CPU vector ISA by loading a test library in a Python subprocess
# with no time limit; under 16 workers those probes hung for minutes on the GPU machine (torch 2.13 bounds
# them). The ISAs /proc/cpuinfo lists are taken as they are instead.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import torch  # noqa: E402,F401  (after the variable above: Inductor reads it at import)

# Under torch.compile, small calls of the built-in ops trace their PyTorch definitions by default
# (opbuilder.torchop.inline); the tests' shapes are small, and their compile tests are there for our kernels
# under compile: 0 keeps the kernels. tests/torchop/test_inline.py tests the default.
os.environ.setdefault("OPB_COMPILE_INLINE_BELOW", "0")

from helpers import ROOT, run_python  # noqa: E402

# Every test process and every child it starts builds into this cache unless told otherwise.
os.environ.setdefault("OPB_CACHE_DIR", str(ROOT / "build" / "test-cache"))


@pytest.fixture(scope="session", autouse=True)
def _cxx_autograd_glue_started() -> None:
    """The ops' C++ gradient glue starts building (or loading) at the start of the run, in the background as
    a first gradient starts it (a child process; under xdist one worker's child builds, the others' wait on
    its lock), while the tests run: no worker sits idle for the build (about 20 s of CPU). Tests whose
    processes need the glue wait for it with ``cxx_autograd_glue``; in this process, calls take the Python
    path until it is there, as a user's first steps do, and ``_cxx_autograd_glue_switch`` loads it between
    tests. tests/torchop/test_cxx_autograd.py tests the background build on caches of its own."""
    from opbuilder.torchop import cxx_autograd

    cxx_autograd.load(wait=False)


@pytest.fixture(autouse=True)
def _cxx_autograd_glue_switch(_cxx_autograd_glue_started: None) -> None:
    """Once the background build has ended, the glue is loaded before the next test starts (from the run's
    cache, before any test's fixture points OPB_CACHE_DIR elsewhere), not at a gradient inside a test."""
    from opbuilder.torchop import cxx_autograd

    if cxx_autograd.state() in ("building", "waiting"):
        cxx_autograd.load(wait=False)  # a poll: loads it if the build has ended, never waits


@pytest.fixture(scope="session")
def cxx_autograd_glue(_cxx_autograd_glue_started: None) -> Path:
    """Waits until the glue is built and loaded; returns the run's cache, which then holds it. For tests whose
    processes record gradients (torchrun's ranks among them): they load it at their first gradient instead
    of each starting a background build mid-test (a rank of tests/torchop/test_dtensor.py once aborted,
    cause not found, while the run's glue was still being built), and a test can copy it into a cache
    of its own (``helpers.copy_builds``)."""
    from opbuilder.torchop import cxx_autograd

    cxx_autograd.load(wait=True)
    return Path(os.environ["OPB_CACHE_DIR"])


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache root for tests that build from scratch."""
    root = tmp_path / "cache"
    monkeypatch.setenv("OPB_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="session")
def built_user_op(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the user op of tests/helpers/userop.py, a cache holding its one build), built once a run (once a worker
    under xdist). A test that needs a warm cache to start from copies it (``copy_cache``) instead of building."""
    from helpers.userop import load_snippet, write_user_op

    base = tmp_path_factory.mktemp("built-user-op")
    op = write_user_op(base / "proj")
    cache = base / "cache"
    result = run_python(load_snippet(op), env={"OPB_CACHE_DIR": str(cache)})
    assert result.returncode == 0 and "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in result.stdout, result.stderr[-3000:]
    assert result.stderr.count("opbuilder: building ") == 1, result.stderr[-3000:]
    return op, cache


# Modules whose module-scoped fixture is expensive: a pip install that prebuilds relu (test_prebuild), a bench
# run (test_bench), relu's build copied into a private cache (test_report_health), a cold build of relu that
# the next tests read (test_cli: its tests must also run in order, on one worker). Under xdist's default "load"
# distribution their tests spread over the workers and every worker sets the fixture up again (on the GPU
# machine a build means nvcc): with "-n N" these modules run on one worker each (xdist's loadgroup, which
# spreads every other test as "load" does).
# test_dispatch_builtin and test_dispatch store traces for one op name in the shared cache and remove them
# afterwards: on two workers, one test's trace would steer, or be removed under, another's.
# test_properties counts the calls of its property tests in the process and checks the counts in its last test:
# spread over two workers, that test would see only its own worker's counts.
ONE_WORKER_MODULES = ("test_prebuild", "test_bench", "test_report_health", "test_cli", "test_dispatch_builtin",
                      "test_dispatch", "test_properties")


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", None) == "load" and not getattr(config.option, "distload", False):
        config.option.dist = "loadgroup"  # the controller: "-n N" alone meant --dist load
    if getattr(config, "workerinput", {}).get("opb_loadgroup"):
        config.option.loadgroup = True  # a worker: it parses the command line again and would not know


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # noqa: ANN001 (xdist's WorkerController; absent without xdist)
    node.workerinput["opb_loadgroup"] = node.config.option.dist == "loadgroup"


@pytest.hookimpl(tryfirst=True)  # before xdist's worker turns the marks into node id suffixes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
        if module in ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
