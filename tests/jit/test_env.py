"""opbuilder.env's yes/no variables: a value read the wrong way turns on what it meant to turn off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opbuilder import env
from helpers import run_module


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), ("Yes", True), (" on ", True), ("2", True),
                                      ("0", False), (" 0", False), ("0 ", False), ("FALSE", False), ("off", False),
                                      ("00", False), ("", False), ("  ", False)])
def test_yes_no_variables(raw: str, want: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_CXX_AUTOGRAD", raw)
    monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", raw)
    assert env.trust_shared_cache() is want
    assert env.cxx_autograd() is (want or raw.strip() == "")  # unset or empty: on, its default


@pytest.mark.parametrize("raw", ["n", "disable", "0x0", "of", "1.0"])
def test_a_yes_no_variable_of_another_value_is_refused_by_name(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", raw)
    with pytest.raises(ValueError, match=rf"OPB_TRUST_SHARED_CACHE must be 1 .* or 0 .*got {raw!r}"):
        env.trust_shared_cache()


def test_the_cli_says_which_variable_is_wrong_without_a_traceback(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    result = run_module("opbuilder", "build", "relu",
                        env={**os.environ, "OPB_CACHE_DIR": str(cache), "OPB_VERBOSE": "loud"})
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "OPB_VERBOSE must be 1" in result.stderr and "'loud'" in result.stderr, result.stderr[-2000:]
