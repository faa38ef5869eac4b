"""opbuilder.env's yes/no variables: a value read the wrong way turns on what it meant to turn off."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from opbuilder import env
from opbuilder.errors import EnvError
from helpers import run_module, run_python


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), ("Yes", True), (" on ", True), ("2", True),
                                      ("0", False), (" 0", False), ("0 ", False), ("FALSE", False), ("off", False),
                                      ("00", False), ("", False), ("  ", False)])
def test_yes_no_variables(raw: str, want: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_CXX_AUTOGRAD", raw)
    monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", raw)
    assert env.trust_shared_cache() is want
    assert env.cxx_autograd() is (want or raw.strip() == "")  # unset or empty: on, its default


@pytest.mark.parametrize("raw", ["n", "disable", "0x0", "of", "1.0", "+-1", "--0"])
def test_a_yes_no_variable_of_another_value_is_refused_by_name(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", raw)
    with pytest.raises(ValueError, match=r"OPB_TRUST_SHARED_CACHE must be 1 .* or 0 .*got " + re.escape(repr(raw))):
        env.trust_shared_cache()


def test_a_whole_number_of_any_length_and_digits_of_another_script(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", "0" * 5000)
    assert env.trust_shared_cache() is False
    monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", "0" * 4999 + "1")
    assert env.trust_shared_cache() is True
    monkeypatch.setenv("OPB_REMOTE_CACHE_MAX_BYTES", "\u00b2")  # '²': isdigit(), not a number int() takes
    with pytest.raises(EnvError, match="OPB_REMOTE_CACHE_MAX_BYTES must be a positive number of bytes"):
        env.remote_cache_max_bytes()


def test_whole_number_variables_of_more_digits_than_int_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's int() refuses more than 4300 digits with a ValueError that names no variable."""
    for name, read in (("OPB_MAX_JOBS", env.max_jobs), ("OPB_REMOTE_CACHE_MAX_BYTES", env.remote_cache_max_bytes)):
        monkeypatch.setenv(name, "9" * 5000)
        if name == "OPB_MAX_JOBS":
            with pytest.raises(EnvError, match="OPB_MAX_JOBS must be a whole number from 1 to 4096, got '9999"):
                read()
        else:
            assert read() == 1 << 63
    monkeypatch.setenv("OPB_MAX_JOBS", "0" * 5000 + "8")
    assert env.max_jobs() == 8
    monkeypatch.setenv("OPB_COMPILE_INLINE_BELOW", "9" * 5000)
    assert env.compile_inline_below() == 1 << 63
    monkeypatch.setenv("OPB_COMPILE_INLINE_BELOW", "0" * 5000)
    assert env.compile_inline_below() == 0


def test_commands_that_build_nothing_run_whatever_the_variables(fresh_cache: Path) -> None:
    odd = {**os.environ, "OPB_VERBOSE": "loud", "OPB_BUILD_DIR": "/somewhere"}
    result = run_module("opbuilder", "clean", env=odd)
    assert result.returncode == 0, result.stderr[-2000:]


def test_bench_says_which_variable_is_wrong_before_timing(fresh_cache: Path) -> None:
    result = run_module("opbuilder", "bench", "relu", "--device", "cpu", "--shapes", "16", "--no-host",
                        env={**os.environ, "OPB_VERBOSE": "loud"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OPB_VERBOSE must be 1" in result.stderr and "ours" not in result.stdout, result.stdout[-2000:]


def test_the_cli_says_which_variable_is_wrong_without_a_traceback(fresh_cache: Path) -> None:
    result = run_module("opbuilder", "build", "relu", env={**os.environ, "OPB_VERBOSE": "loud"})
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "OPB_VERBOSE must be 1" in result.stderr and "'loud'" in result.stderr, result.stderr[-2000:]


def test_a_blank_build_variable_is_unset_and_another_tools_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from opbuilder.jit import prebuild

    for name in [n for n in os.environ if n.startswith("OPB_BUILD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OPB_BUILD_OPS", "1")
    monkeypatch.setenv("OPB_BUILD_RELU", " ")  # blank: unset, relu is built with the others
    assert prebuild.requested() == (True, {})
    monkeypatch.setenv("OPB_BUILD_DIR", "/somewhere")  # not ours: named as no op, not parsed as yes/no
    with pytest.raises(prebuild.PrebuildError, match="OPB_BUILD_DIR names no built-in op"):
        prebuild.requested()


_CALL = """
import torch
from opbuilder import ops
try:
    ops.relu(torch.randn(8))
except ValueError as exc:
    print("raised", type(exc).__name__, exc)
else:
    print("ran")
"""


def test_a_wrong_variable_is_raised_by_the_call_not_taken_for_a_reason_to_fall_back(fresh_cache: Path) -> None:
    # read by a build and by a load of a prebuilt library alike
    result = run_python(_CALL, env={"OPB_TRUST_SHARED_CACHE": "loud"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("raised EnvError OPB_TRUST_SHARED_CACHE must be 1"), \
        result.stdout + result.stderr[-2000:]
    assert "FallbackWarning" not in result.stderr, result.stderr[-2000:]


def test_check_with_a_wrong_variable_records_no_verdict(fresh_cache: Path) -> None:
    result = run_module("opbuilder", "check", "relu", env={**os.environ, "OPB_VERBOSE": "loud"})
    assert result.returncode == 1 and "OPB_VERBOSE must be 1" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not list(fresh_cache.rglob("*.check.json")), list(fresh_cache.rglob("*"))


def test_no_home_folder_is_an_env_error_naming_opb_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container user with no passwd entry and no HOME (``docker run --user 12345`` under ``env -i``): the
    default cache root raised pathlib's bare RuntimeError("Could not determine home directory.")."""
    import pwd

    for name in ("OPB_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(EnvError, match="set OPB_CACHE_DIR"):
        env.cache_root()


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The XDG base directory spec: a relative XDG_CACHE_HOME is invalid and is ignored. It was taken from the
    working folder, so ranks started in different folders each built into a cache of their own there."""
    monkeypatch.delenv("OPB_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.chdir(tmp_path)
    assert env.cache_root() == tmp_path / "home" / ".cache" / "opbuilder"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.cache_root() == tmp_path / "xdg" / "opbuilder"
