"""The ``opbuilder`` command: report, build, clean, new's argument checks, bench's dispatch.

One fresh cache is shared by this file's tests, in order: report on the empty cache, ``build relu``,
a warm load, report again, then clean. relu is the only op built (the cheapest one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from filelock import FileLock

from helpers import ROOT, run_module
from opbuilder.jit import registry
from opbuilder.tools import cli, report


def _env(cache_root: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OPB_CACHE_DIR"] = str(cache_root)
    env.update(extra)
    return env


def _cli(cache_root: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return run_module("opbuilder", *args, env=_env(cache_root), timeout=timeout)


def _report(cache_root: Path) -> dict:
    proc = _cli(cache_root, "report", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _row(data: dict, op: str = "relu") -> dict:
    return next(r for r in data["ops"] if r["op"] == op)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli") / "cache"


# ---- help, python -m, bench -------------------------------------------------------------------


def test_help_lists_the_commands_and_imports_no_torch() -> None:
    code = (
        "import sys\nfrom opbuilder.tools.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'torch' not in sys.modules, 'opbuilder --help imported torch'\n"
        "import opbuilder.tools.report, opbuilder.jit.prebuild, opbuilder.tools.scaffold\n"
        "assert 'torch' not in sys.modules, 'importing the CLI modules imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for command in ("report", "build", "clean", "new", "bench"):
        assert command in proc.stdout
    via_m = subprocess.run([sys.executable, "-m", "opbuilder", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert via_m.returncode == 0 and "report" in via_m.stdout


def test_bench_gets_every_remaining_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("opbuilder.tools.bench")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "opbuilder.tools.bench", fake)
    import opbuilder.tools

    monkeypatch.setattr(opbuilder.tools, "bench", fake, raising=False)
    assert cli.main(["bench", "relu", "--help", "--shapes", "8x8"]) == 3
    assert seen == [["relu", "--help", "--shapes", "8x8"]]


def test_usage_errors(cache_root: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["build"]) == 2
    assert "pass --all" in capsys.readouterr().err
    assert cli.main(["build", "no_such_op"]) == 2
    err = capsys.readouterr().err
    assert "no built-in op named no_such_op" in err and "relu" in err
    assert cli.main(["new", "Bad-Name", "--dir", str(cache_root.parent)]) == 2
    assert "lower_snake_case" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["check", "tune"])
@pytest.mark.parametrize("device", ["foo", "cuda:x", "meta"])
def test_check_and_tune_name_a_bad_device(cache_root: Path, capsys: pytest.CaptureFixture, command: str,
                                           device: str) -> None:
    assert cli.main([command, "relu", "--device", device]) == 1
    err = capsys.readouterr().err
    assert f"--device must be cpu or cuda, got {device!r}" in err and "Traceback" not in err


@pytest.mark.parametrize("budget", ["nan", "inf", "-5", "0"])
def test_tune_names_a_bad_budget_before_checking(cache_root: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch, budget: str) -> None:
    from opbuilder.dispatch import check

    monkeypatch.setattr(check, "check", lambda *a, **k: pytest.fail("checked before the budget was looked at"))
    assert cli.main(["tune", "relu", "--budget-ms", budget]) == 1
    err = capsys.readouterr().err
    assert f"--budget-ms (the time budget per implementation and workload) must be a finite number > 0, got {float(budget)!r}" in err


@pytest.mark.parametrize("command", ["compile-commands", "compile-check"])
@pytest.mark.parametrize(("spec", "got"), [("os:NoSuchThing", "got nothing as 'NoSuchThing' in os"),
                                          ("os:path", "got <module"), ("os:getcwd", "got <built-in function")])
def test_compile_commands_names_a_builder_that_is_not_one(command: str, spec: str, got: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    assert cli.main([command, spec]) == 1
    err = capsys.readouterr().err
    assert f"{spec}: expected module:Class naming an OpBuilder subclass, {got}" in err


def test_compile_commands_names_an_output_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "no such folder" / "compile_commands.json"
    assert cli.main(["compile-commands", "relu", "-o", str(out)]) == 1
    assert f"--output {out}: cannot write it (No such file or directory)" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["abs", "..", "../outside", "relu/../.."])
def test_clean_takes_op_names_not_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture, where: str) -> None:
    """root / "/abs" is "/abs": a path removed the key-named folders of any folder, then crashed in a glob."""
    outside = tmp_path / "outside"
    build = outside / ("0123456789abcdef" * 2)[:20]
    build.mkdir(parents=True)
    (build / "data").write_text("not the cache's")
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    op = str(outside) if where == "abs" else where
    assert cli.main(["clean", op]) == 2
    assert f"OP must be an op's name (letters, digits and '_', as in the cache's folders), got {op!r}" in \
        capsys.readouterr().err
    assert (build / "data").read_text() == "not the cache's" and os.listdir(outside) == [build.name]


# ---- report, build, warm load, clean (in this order, one cache) ---------------------------------


def test_report_on_an_empty_cache(cache_root: Path) -> None:
    data = _report(cache_root)
    assert [r["op"] for r in data["ops"]] == registry.names(), "one row per registered op"
    row = _row(data)
    assert row["compatible"] is True and row["cached"] is False and row["building"] is False
    assert row["last_build"] is None and row["key"]
    assert data["cache"]["root"] == str(cache_root)
    assert data["versions"]["torch"]["version"] and data["versions"]["python"]["version"]
    text = _cli(cache_root, "report")
    assert text.returncode == 0 and "host compiler" in text.stdout and str(cache_root) in text.stdout


def test_build_relu_from_an_empty_cache_then_a_warm_load(cache_root: Path) -> None:
    proc = _cli(cache_root, "build", "relu")
    assert proc.returncode == 0, proc.stderr
    # One line when the build starts (and why), one when it ends; nothing else.
    assert re.fullmatch(r"opbuilder: building relu \(cpu[^)]*\): first build here\n"
                        r"opbuilder: built relu in [\d.]+ s \(\d of \d files compiled\)\n", proc.stderr), proc.stderr
    again = _cli(cache_root, "build", "relu")
    assert again.returncode == 0 and "relu: already in the cache" in again.stderr
    code = "import torch\nfrom opbuilder.ops import relu\nprint(relu(torch.tensor([-1.0, 2.0])).tolist())"
    load = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(cache_root), cwd=ROOT)
    assert load.returncode == 0, load.stderr
    assert load.stdout.strip() == "[0.0, 2.0]"
    assert "building" not in load.stderr, "a warm load after `opbuilder build` must not compile"


def test_report_after_the_build(cache_root: Path) -> None:
    row = _row(_report(cache_root))
    assert row["cached"] is True and row["building"] is False
    assert row["last_build"]["ok"] is True and row["last_build"]["at"]
    assert Path(row["log"]).is_file()
    assert row["cache_path"] == str(cache_root / "relu" / row["key"])


def test_report_sees_a_held_lock(cache_root: Path) -> None:
    key = _row(_report(cache_root))["key"]
    with FileLock(str(cache_root / "relu" / f"{key}.lock")):
        assert _row(_report(cache_root))["building"] is True


def test_report_shows_a_builder_that_fails_to_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.BUILDERS, "broken", "opbuilder.builders.no_such_module:Nope")
    row = report.op_row("broken")
    assert row["compatible"] is False
    assert "its builder failed to import: ModuleNotFoundError" in row["reasons"][0]


def _fake_stale_build(current: Path, op: str, key: str, **changes: object) -> Path:
    """A copy of relu's ``current`` build under another key, its manifest edited by ``changes``."""
    fake = current.parent.parent / op / key
    shutil.copytree(current, fake)
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["key"] = key
    manifest["inputs"].update(changes)
    (fake / "manifest.json").write_text(json.dumps(manifest))
    return fake


def test_clean_stale_leaves_current_builds(cache_root: Path) -> None:
    current = Path(_row(_report(cache_root))["cache_path"])
    old_torch = _fake_stale_build(current, "relu", "0" * 20, abi="classic", torch="2.0.0")
    other_archs = _fake_stale_build(current, "relu", "1" * 20, cuda_archs=["8.0"])  # can be asked for again
    user_stale = _fake_stale_build(current, "my_user_op", "2" * 20, abi="classic", python="cpython-30")
    busy = _fake_stale_build(current, "relu", "3" * 20, abi="classic", torch="2.0.0")
    with FileLock(str(cache_root / "relu" / f"{'3' * 20}.lock")):
        proc = _cli(cache_root, "clean", "--stale")
    assert proc.returncode == 0, proc.stderr
    assert not old_torch.exists() and not user_stale.exists()
    assert f"relu/{'0' * 20}: removed" in proc.stdout and "built for torch 2.0.0" in proc.stdout
    assert current.is_dir() and other_archs.is_dir(), proc.stdout
    assert busy.is_dir() and "another process is building it" in proc.stdout
    assert _row(_report(cache_root))["cached"] is True


def test_clean_op_removes_its_builds_but_not_a_locked_one(cache_root: Path) -> None:
    copy = cache_root.parent / "cache-copy"
    shutil.copytree(cache_root, copy)
    locked = "1" * 20
    with FileLock(str(copy / "relu" / f"{locked}.lock")):
        proc = _cli(copy, "clean", "relu")
    assert proc.returncode == 0, proc.stderr
    left = [p.name for p in report.cached_keys(copy / "relu")]
    assert left == [locked], f"expected only the locked build left, found {left}"
    assert _row(_report(copy))["cached"] is False


# ---- build: failure and parallel paths ----------------------------------------------------------

BROKEN_BUILDER = '''
from opbuilder import OpBuilder


class BrokenBuilder(OpBuilder):
    NAME = "broken_op"

    def sources(self):
        return ["broken.cpp"]
'''


def test_parallel_build_reports_each_op_and_fails_with_the_compiler_error(
    cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "brokenop_builder.py").write_text(textwrap.dedent(BROKEN_BUILDER))
    (tmp_path / "broken.cpp").write_text("int f() { return undefined_symbol_opb; }\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OPB_CACHE_DIR", str(cache_root))
    monkeypatch.setitem(registry.BUILDERS, "broken_op", "brokenop_builder:BrokenBuilder")
    monkeypatch.delitem(registry._INSTANCES, "broken_op", raising=False)
    assert cli.main(["build", "relu", "broken_op", "--jobs", "2"]) == 1
    out = capsys.readouterr()
    assert "relu: already in the cache" in out.err
    assert "building broken_op (cpu): first build here" in out.err
    assert "broken_op: FAILED" in out.err
    assert "undefined_symbol_opb" in out.err and "error" in out.err
    assert "failed: broken_op" in out.err
