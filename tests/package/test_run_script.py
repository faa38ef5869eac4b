"""``./run test``: pytest's arguments. A verbosity the caller gives replaces the default -q, so
``./run test -q`` keeps pytest's summary line (``-q -q`` dropped it)."""

from __future__ import annotations

import subprocess

import pytest

from helpers import ROOT


def _pytest_args(*args: str) -> list[str]:
    script = 'source ./run; pytest_args "$@"; printf "%s\\0" "${PYTEST_ARGS[@]}"'
    result = subprocess.run(["bash", "-c", script, "run", *args], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\0")[:-1]


@pytest.mark.parametrize(
    "args, expected",
    [
        ((), ["-q"]),
        (("-x", "tests/test_cli.py"), ["-q", "-x", "tests/test_cli.py"]),
        (("-q",), ["-q"]),
        (("-x", "-q", "-k", "not slow"), ["-x", "-q", "-k", "not slow"]),
        (("-xq",), ["-xq"]),
        (("-v",), ["-v"]),
        (("-vv", "tests"), ["-vv", "tests"]),
        (("--verbose",), ["--verbose"]),
        (("--verbosity=2",), ["--verbosity=2"]),
        (("-p", "no:cacheprovider", "-k", "quick"), ["-q", "-p", "no:cacheprovider", "-k", "quick"]),
    ],
)
def test_run_test_passes_one_verbosity(args: tuple[str, ...], expected: list[str]) -> None:
    assert _pytest_args(*args) == expected


def test_sourcing_run_defines_functions_and_runs_nothing() -> None:
    result = subprocess.run(["bash", "-c", "source ./run; type setup main >/dev/null"], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
