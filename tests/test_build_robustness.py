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

import twofile
from conftest import ROOT, run_python
from opbuilder import OpBuilder, cache, compile as ninja_build, env

X = torch.arange(3, dtype=torch.float32)


def _work_folders(cache_root: Path, op: str) -> list[Path]:
    return sorted(p for p in (cache_root / ninja_build.WORK_ROOT).glob(f"{op}-*") if p.is_dir())


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
    original = ninja_build.write_ninja
    stepped = time.time()

    def write_ninja_after_the_step(spec, work: Path) -> Path:
        target = original(spec, work)
        for folder in (work / ninja_build.SRC_DIR, work / ninja_build.GEN_DIR):
            for dirpath, _dirs, files in os.walk(folder):
                for name in files:
                    path = os.path.join(dirpath, name)
                    if os.stat(path).st_mtime >= stepped:
                        os.utime(path, (stepped - DAY, stepped - DAY))
        return target

    monkeypatch.setattr(ninja_build, "write_ninja", write_ninja_after_the_step)


def _build_then_run(builder, root: Path, op: str, expected: list[float]) -> None:
    """Build here (under the stepped clock), then load and run in a fresh process: a stale library published
    under the new key cannot load there (its namespace is the old key's), and in this process it would
    register the old namespace a second time."""
    from opbuilder import build

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


@pytest.mark.parametrize("name", ["../escape", "my-op", "a/b", "1op", "op name", ".", "opé", "op\n"])
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


def test_a_project_and_a_cache_in_folders_with_spaces_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "my cache"))
    root = twofile.write_op(tmp_path / "My Kernels" / "proj one", name="spaced")
    (root / "csrc" / "value.h").write_text("#pragma once\nconstexpr float kValue = 6;\n")
    twofile.set_kernel(root, "kValue", extra='#include "value.h"')
    built = twofile.builder(root)
    assert built.load().spaced(X).tolist() == [0, 6, 12]
    manifest = cache.read_manifest(cache.Slot("spaced", built.key).path)
    assert manifest is not None and sorted(manifest["compiled"]) == ["binding.cpp", "kernel.cpp"]
    twofile.set_kernel(root, "(kValue + 1)", extra='#include "value.h"')
    assert twofile.builder(root).load().spaced(X).tolist() == [0, 7, 14]
