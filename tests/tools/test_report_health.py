"""``opbuilder report`` names what is wrong in the cache (issue 6, items 3 and 6): a corrupt build at the
current key (truncated or garbage library, missing library, missing or garbled manifest) with the
reason, stale builds of other keys (another torch) with theirs, and stray temporary build folders.

relu (the cheapest op) is built once into a private cache; each test copies that cache into its own
``fresh_cache`` and damages the copy.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from helpers import run_module, run_python
from opbuilder.tools import report


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding one good build of relu: relu's current build, taken from the run's shared cache (built
    there once per run, whichever worker comes first; on a GPU machine a cold build means nvcc)."""
    proc = run_module("opbuilder", "build", "relu", timeout=900)  # OPB_CACHE_DIR: the shared cache (conftest)
    assert proc.returncode == 0, proc.stderr
    source = Path(report.op_row("relu")["cache_path"])
    assert source.is_dir() and source.parent.parent == Path(os.environ["OPB_CACHE_DIR"]), source
    root = tmp_path_factory.mktemp("health") / "cache"
    (root / "relu").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    shutil.copytree(source, root / "relu" / source.name, symlinks=True)
    return root


@pytest.fixture
def cache(built: Path, fresh_cache: Path) -> Path:
    """A copy of ``built`` at ``fresh_cache`` (OPB_CACHE_DIR points there), modes and times kept."""
    shutil.copytree(built, fresh_cache, symlinks=True)
    return fresh_cache


def _current(cache_root: Path) -> tuple[dict, Path, dict]:
    """relu's report row, its build folder at the current key, and that build's manifest."""
    row = report.op_row("relu")
    assert row["cached"] is True and row["corrupt"] is None, row
    build = Path(row["cache_path"])
    return row, build, json.loads((build / "manifest.json").read_text())


def _report_json(cache_root: Path) -> dict:
    proc = run_module("opbuilder", "report", "--json", env={**os.environ, "OPB_CACHE_DIR": str(cache_root)})
    assert proc.returncode == 0, proc.stderr
    return next(r for r in json.loads(proc.stdout)["ops"] if r["op"] == "relu")


def _report_text(cache_root: Path) -> str:
    proc = run_module("opbuilder", "report", env={**os.environ, "OPB_CACHE_DIR": str(cache_root)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_good_build_is_reported_healthy(cache: Path) -> None:
    row, _, _ = _current(cache)
    assert row["stale"] == [] and row["stray_tmp"] == [] and row["other_builds"] == 0


def _truncate(build: Path, manifest: dict) -> None:
    lib = build / manifest["artifact"]
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])


def _garbage(build: Path, manifest: dict) -> None:
    lib = build / manifest["artifact"]
    lib.write_bytes(b"\x7fELF" + os.urandom(lib.stat().st_size - 4))  # same size: only the hash tells


def _no_library(build: Path, manifest: dict) -> None:
    (build / manifest["artifact"]).unlink()


def _no_manifest(build: Path, manifest: dict) -> None:
    (build / "manifest.json").unlink()


def _garbled_manifest(build: Path, manifest: dict) -> None:
    (build / "manifest.json").write_text('{"artifact": ')


def _manifest_without_record(build: Path, manifest: dict) -> None:
    del manifest["artifact_sha256"]
    (build / "manifest.json").write_text(json.dumps(manifest))


DAMAGES = {
    "truncated library": (_truncate, "bytes, the manifest says"),
    "garbage library of the same size": (_garbage, "does not match the hash in its manifest"),
    "missing library": (_no_library, "artifact missing in"),
    "missing manifest": (_no_manifest, "manifest missing or unreadable in"),
    "garbled manifest": (_garbled_manifest, "manifest missing or unreadable in"),
    "manifest without the library's record": (_manifest_without_record, "artifact_sha256 None is not a sha256"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_corrupt_build_is_reported_with_the_reason(damage: str, cache: Path) -> None:
    _, build, manifest = _current(cache)
    damage_fn, reason = DAMAGES[damage]
    damage_fn(build, manifest)
    row = report.op_row("relu")
    assert row["cached"] is False
    assert row["corrupt"] is not None and reason in row["corrupt"], row["corrupt"]
    text = report.render({**report.collect(), "ops": [row]})
    assert "CORRUPT" in text and reason in text and "the next load rebuilds it" in text, text


def _stale_copy(build: Path, key: str, **changes: object) -> Path:
    """A copy of ``build`` under ``key``, its manifest's key inputs changed by ``changes``."""
    copy = build.parent / key
    shutil.copytree(build, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["key"] = key
    manifest["inputs"].update(changes)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_a_build_for_another_torch_is_reported_stale(cache: Path) -> None:
    _, build, _ = _current(cache)
    old = _stale_copy(build, "0" * 20, abi="classic", torch="2.0.0")
    _stale_copy(build, "1" * 20, cuda_archs=["8.0"])  # another arch list can be asked for again: not stale
    _stale_copy(build, "2" * 20, torch="2.99.0")  # relu is a stable-ABI op: another torch can still load it
    row = report.op_row("relu")
    assert row["cached"] is True and row["corrupt"] is None
    assert row["other_builds"] == 3
    assert [s["key"] for s in row["stale"]] == ["0" * 20], row["stale"]
    assert row["stale"][0]["path"] == str(old)
    assert row["stale"][0]["reason"].startswith("built for torch 2.0.0, this environment has ")


def test_a_stray_temporary_folder_is_reported_unless_its_build_is_running(cache: Path) -> None:
    row, build, manifest = _current(cache)
    stray = build.parent / f".tmp-{row['key']}-99999-abc"
    stray.mkdir()
    (stray / manifest["artifact"]).write_bytes(b"half a library")
    assert report.op_row("relu")["stray_tmp"] == [str(stray)]
    with FileLock(str(build.parent / f"{row['key']}.lock")):  # a build of that key is running: its folder
        assert report.op_row("relu")["stray_tmp"] == []


def test_the_command_reports_all_three_then_a_load_repairs_them(cache: Path) -> None:
    """``opbuilder report --json`` and the text report, on a cache with a truncated library, a stale
    build and a stray temporary folder; then one load rebuilds, and removes the stray folder of its key."""
    row, build, manifest = _current(cache)
    _stale_copy(build, "0" * 20, abi="classic", torch="2.0.0")
    stray = build.parent / f".tmp-{row['key']}-99999-abc"
    stray.mkdir()
    _truncate(build, manifest)

    data = _report_json(cache)
    assert data["cached"] is False and "bytes, the manifest says" in data["corrupt"]
    assert [s["key"] for s in data["stale"]] == ["0" * 20] and "built for torch 2.0.0" in data["stale"][0]["reason"]
    assert data["stray_tmp"] == [str(stray)]
    text = _report_text(cache)
    relu_line = next(ln for ln in text.splitlines() if ln.startswith("relu "))
    assert "CORRUPT" in relu_line, relu_line
    assert f"relu: STALE build {'0' * 20}: built for torch 2.0.0" in text
    assert f"relu: STRAY temporary build folder {stray}" in text

    load = run_python("import torch\nfrom opbuilder.ops import relu\nprint(relu(torch.tensor([-1.0, 2.0])).tolist())")
    assert load.returncode == 0 and load.stdout.strip() == "[0.0, 2.0]", load.stderr
    assert "opbuilder: building relu" in load.stderr, "a corrupt build must be rebuilt"
    after = _report_json(cache)
    assert after["cached"] is True and after["corrupt"] is None and after["stray_tmp"] == []
    assert [s["key"] for s in after["stale"]] == ["0" * 20], "the stale build stays until `clean --stale`"
