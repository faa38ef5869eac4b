"""Every path inside the cache comes from opbuilder.paths, whose docstring lists every entry."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from opbuilder import paths


def test_the_docstring_lists_every_entry_of_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path))
    doc = paths.__doc__ or ""
    entries = {
        "op_dir": paths.op_dir("<op>"), "build_dir": paths.build_dir("<op>", "<key>"), "lock": paths.lock("<op>", "<key>"),
        "failure": paths.failure("<op>", "<key>"), "failure_log": paths.failure_log("<op>", "<key>"),
        "discovered": paths.discovered("<op>"), "work_dir": paths.work_dir("<op>", "<hash>"),
        "work_lock": paths.work_lock(paths.work_dir("<op>", "<hash>")), "slots_dir": paths.slots_dir(),
        "compilers": paths.compilers(), "trace": paths.trace("<op>", "<key>"), "check": paths.trace("<op>", "<key>", "check"),
        "key_memo": paths.key_memo("<op>"), "trace_lock": paths.trace_lock("<op>", "<key>"),
        "build_starter": paths.build_starter("<op>", "<key>"),
    }
    for name, path in entries.items():
        assert path.is_relative_to(tmp_path), name
        entry = str(path.relative_to(tmp_path)).replace(f"-{os.getuid()}.", "-<uid>.")
        assert entry in doc, f"{name}: {entry} is not in the docstring"
    functions = {n for n, f in inspect.getmembers(paths, inspect.isfunction) if f.__module__ == paths.__name__}
    # check_op_name is no path: the check that keeps an op's traces folder inside the cache.
    assert functions - {"root", "traces", "work_root", "check_op_name"} <= set(entries), \
        "a new cache path: list it here and in the docstring"
    for name in ("MANIFEST", "LOG", "TMP_PREFIX", "WORK_SOURCES", "WORK_GENERATED", "WORK_BUILDING", "WORK_OBJECTS"):
        assert getattr(paths, name).rstrip("/") in doc, name


def test_no_module_builds_a_cache_path_itself() -> None:
    """The cache root is read in paths (and in messages that name it); nothing else joins names onto it."""
    package = Path(paths.__file__).parent
    for module in sorted(package.rglob("*.py")):
        if module.name == "paths.py":
            continue
        for number, line in enumerate(module.read_text().splitlines(), 1):
            assert "cache_root() /" not in line, f"{module.relative_to(package.parent)}:{number}: {line.strip()}"
