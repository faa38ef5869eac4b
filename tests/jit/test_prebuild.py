"""Prebuild at install time (setup.py + OPB_BUILD_*), and the choice at load between a prebuilt
library and the JIT cache.

One real ``pip install --no-build-isolation --target`` of a copy of the project, prebuilding relu
only (the cheapest op), is shared by the tests of this file. Loads then run in fresh processes whose
working folder is not the checkout, so they import the installed package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

PROJECT_FILES = ("opbuilder", "ops", "kernels", "pyproject.toml", "setup.py", "README.md")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any OPB_BUILD_* (a developer's shell may set some), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPB_BUILD_")}
    env.update(extra)
    return env


def _copy_project(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "_prebuilt", "*.egg-info", "*.so")
    for name in PROJECT_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    if not (dest / "README.md").exists():
        (dest / "README.md").write_text("opbuilder\n")
    return dest


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _python(code: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-c", code], cwd, _clean_env(**extra))


LOAD_RELU = """
import json, torch, opbuilder
from opbuilder import get_builder
b = get_builder("relu")
ns = b.load()
x = torch.tensor([-2.0, 0.5, float("nan"), 3.0])
y = ns.relu(x)
from opbuilder.ops import relu  # the wrapper must register on the namespace actually loaded
xg = torch.tensor([-1.0, 2.0], requires_grad=True)
relu(xg).sum().backward()
assert xg.grad.tolist() == [0.0, 1.0], xg.grad
print("RESULT", json.dumps({"file": opbuilder.__file__, "ns": ns.name, "y": [str(v) for v in y.tolist()]}))
"""


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """pip-install a copy of the project into a target folder with OPB_BUILD_RELU=1."""
    base = tmp_path_factory.mktemp("prebuild")
    src = _copy_project(base / "src")
    site = base / "site"
    env = _clean_env(OPB_BUILD_RELU="1", OPB_CACHE_DIR=str(base / "install-cache"))
    argv = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-cache-dir",
            "--disable-pip-version-check", "--target", str(site), str(src)]
    proc = _run(argv, base, env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    record_path = site / "opbuilder" / "_prebuilt" / "relu" / "manifest.json"
    return {"base": base, "src": src, "site": site, "output": proc.stdout + proc.stderr, "record_path": record_path}


def test_install_prebuilds_the_named_op_and_says_so(installed: dict) -> None:
    out = installed["output"]
    assert "opbuilder: prebuilt relu in" in out
    assert "opbuilder: prebuilt 1 op(s): relu" in out
    prebuilt = installed["site"] / "opbuilder" / "_prebuilt"
    assert sorted(p.name for p in prebuilt.iterdir()) == ["relu"], "only the op asked for is prebuilt"
    record = json.loads(installed["record_path"].read_text())
    assert record["torch"] == torch.__version__
    assert record["torch_cuda"] == torch.version.cuda
    # relu is a stable-ABI op: its record names the ABI target, not the exact torch that built it.
    assert record["requires"]["abi"] == "stable-2.10" and "torch" not in record["requires"]
    assert record["with_cuda"] == bool(record["cuda_archs"])
    assert (prebuilt / "relu" / record["artifact"]).is_file()
    assert record["namespace"] == f"opb_relu_{record['key'][:12]}"
    assert not any("-march" in a for a in record["requires"]["cxx_args"]), "a prebuilt library must be portable"
    templates = installed["site"] / "opbuilder" / "templates" / "op"
    assert (templates / "ops.py.tmpl").is_file() and (templates / "csrc" / "NAME.cu.tmpl").is_file(), "package data"


def test_prebuilt_op_is_used_without_compiling(installed: dict, tmp_path: Path) -> None:
    cache_root = tmp_path / "empty-cache"
    # OPB_CXX_AUTOGRAD=0: the gradient takes the Python path, as it did while the C++ glue's background build
    # (which outlived this process: 20 s of CPU into a cache thrown away) ran; the glue is not this test's.
    proc = _python(LOAD_RELU, tmp_path, PYTHONPATH=str(installed["site"]), OPB_CACHE_DIR=str(cache_root),
                   OPB_CXX_AUTOGRAD="0")
    result = _result(proc)
    record = json.loads(installed["record_path"].read_text())
    assert Path(result["file"]).is_relative_to(installed["site"]), "the installed package must be the one imported"
    assert result["ns"] == record["namespace"]
    assert result["y"] == ["0.0", "0.5", "nan", "3.0"]
    assert "building" not in proc.stderr and "not using" not in proc.stderr, proc.stderr
    assert not (cache_root / "relu").exists(), "the cache must hold no build of relu"

    report = _run([sys.executable, "-m", "opbuilder", "report", "--json"], tmp_path,
                  _clean_env(PYTHONPATH=str(installed["site"]), OPB_CACHE_DIR=str(cache_root)))
    assert report.returncode == 0, report.stderr
    row = next(r for r in json.loads(report.stdout)["ops"] if r["op"] == "relu")
    assert row["prebuilt"]["usable"] is True and row["cached"] is False


def test_prebuilt_op_needs_no_compiler_and_no_cache(installed: dict, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache root below a file cannot be created
    proc = _python(LOAD_RELU, tmp_path, PYTHONPATH=str(installed["site"]), OPB_CACHE_DIR=str(blocker / "cache"),
                   CXX="no-such-compiler-opb", CUDA_HOME=str(tmp_path / "no-cuda"))
    result = _result(proc)
    assert result["ns"] == json.loads(installed["record_path"].read_text())["namespace"]
    assert result["y"] == ["0.0", "0.5", "nan", "3.0"]


def test_mismatched_prebuilt_is_ignored_with_one_line(installed: dict, tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(installed["site"], site)
    record_path = site / "opbuilder" / "_prebuilt" / "relu" / "manifest.json"
    record = json.loads(record_path.read_text())
    record["requires"]["abi"] = "stable-2.9"  # a library made for another ABI target
    record_path.write_text(json.dumps(record))
    # The shared test cache: relu is usually built there already, which keeps this test fast.
    proc = _python(LOAD_RELU + "b.load(); print(b.namespace)", tmp_path, PYTHONPATH=str(site))
    result = _result(proc)
    assert result["ns"] != record["namespace"], "the mismatched prebuilt library was loaded"
    assert result["ns"] == proc.stdout.strip().splitlines()[-1], "the JIT build's namespace"
    assert result["y"] == ["0.0", "0.5", "nan", "3.0"]
    lines = [ln for ln in proc.stderr.splitlines() if "not using the prebuilt relu" in ln]
    assert len(lines) == 1, proc.stderr
    assert "built for the torch ABI stable-2.9, this process has stable-2.10" in lines[0]
    assert "building it JIT" in lines[0]


def test_prebuilt_with_other_sources_is_not_used(installed: dict, tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(installed["site"], site)
    kernel = site / "opbuilder" / "kernels" / "relu" / "relu_cpu.cpp"
    kernel.write_text(kernel.read_text() + "\n// edited after install\n")
    code = "from opbuilder import get_builder\nfrom opbuilder.jit import prebuilt\nprint('WHY', prebuilt.find(get_builder('relu').prebuilt_wanted())[2])"
    proc = _python(code, tmp_path, PYTHONPATH=str(site))
    assert proc.returncode == 0, proc.stderr
    assert "WHY its sources differ from the installed ones (op/relu/relu_cpu.cpp)" in proc.stdout


def _setup_py(src: Path, argv: list[str], hide_torch: bool = False, **extra: str) -> subprocess.CompletedProcess:
    code = (
        "import sys, runpy\n"
        + ("sys.modules['torch'] = None\n" if hide_torch else "")
        + f"sys.argv = ['setup.py', *{argv!r}]\n"
        "runpy.run_path('setup.py', run_name='__main__')\n"
    )
    return _run([sys.executable, "-c", code], src, _clean_env(**extra))


def test_prebuild_without_torch_fails_with_the_command(installed: dict) -> None:
    proc = _setup_py(installed["src"], ["egg_info"], hide_torch=True, OPB_BUILD_OPS="1")
    assert proc.returncode != 0
    assert "torch cannot be imported" in proc.stderr
    assert "OPB_BUILD_OPS=1 pip install --no-build-isolation --no-cache-dir ." in proc.stderr


def test_no_prebuild_asked_imports_no_torch(installed: dict) -> None:
    proc = _setup_py(installed["src"], ["--name"], hide_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("opbuilder")


def test_named_op_that_cannot_be_built_fails_the_install(installed: dict) -> None:
    proc = _setup_py(installed["src"], ["--name"], OPB_BUILD_RELU="1", CXX="no-such-compiler-opb")
    assert proc.returncode != 0
    assert "cannot prebuild relu" in proc.stderr and "no-such-compiler-opb" in proc.stderr


def test_under_build_ops_an_incompatible_op_is_skipped_with_its_reason(installed: dict) -> None:
    proc = _setup_py(installed["src"], ["build_ext", "--help"], OPB_BUILD_OPS="1", CXX="no-such-compiler-opb")
    assert proc.returncode == 0, proc.stderr
    assert "skipping relu: C++ compiler 'no-such-compiler-opb' not found" in proc.stderr


def test_build_var_zero_excludes_and_a_misspelt_one_is_refused(installed: dict) -> None:
    proc = _setup_py(installed["src"], ["build_ext", "--help"], OPB_BUILD_OPS="1", OPB_BUILD_RELU="0",
                     CXX="no-such-compiler-opb")
    assert proc.returncode == 0, proc.stderr
    assert "skipping relu" not in proc.stderr and "prebuild relu" not in proc.stderr, "OPB_BUILD_RELU=0 leaves relu out"
    proc = _setup_py(installed["src"], ["--name"], OPB_BUILD_RELUU="1")
    assert proc.returncode != 0
    assert "OPB_BUILD_RELUU names no built-in op" in proc.stderr and "OPB_BUILD_RELU," in proc.stderr


def test_pip_build_isolation_fails_with_the_command(installed: dict, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
            "--target", str(tmp_path / "site"), str(installed["src"])]
    proc = _run(argv, tmp_path, _clean_env(OPB_BUILD_RELU="1"), timeout=300)
    out = proc.stdout + proc.stderr
    if "Getting requirements to build wheel" not in out:
        pytest.skip("pip could not set up an isolated build environment here (offline?)")
    assert proc.returncode != 0
    assert "OPB_BUILD_RELU=1 pip install --no-build-isolation --no-cache-dir ." in out


def test_prebuilt_op_loads_from_a_read_only_cache(installed: dict, tmp_path: Path) -> None:
    from helpers import mounts

    if not mounts.can_mount():
        pytest.skip("needs root and unshare(1) allowed to mount (a private mount namespace makes the read-only cache)")
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    quoted = str(root)
    proc = mounts.in_mount_namespace(f"mount --bind {quoted} {quoted} && mount -o remount,bind,ro {quoted}", LOAD_RELU, cwd=tmp_path,
                               **_clean_env(PYTHONPATH=str(installed["site"]), OPB_CACHE_DIR=str(root)))
    result = _result(proc)
    assert result["ns"] == json.loads(installed["record_path"].read_text())["namespace"]
    assert result["y"] == ["0.0", "0.5", "nan", "3.0"]


def test_prebuilt_folder_others_can_write_is_not_used(installed: dict, tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(installed["site"], site)
    folder = site / "opbuilder" / "_prebuilt" / "relu"
    folder.chmod(0o775)
    # No compiler: the JIT fallback fails, so nothing but the refused prebuilt library could be loaded.
    proc = _python(LOAD_RELU, tmp_path, PYTHONPATH=str(site), OPB_CACHE_DIR=str(tmp_path / "cache"),
                   CXX="no-such-compiler-opb")
    assert proc.returncode != 0, proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "not using the prebuilt relu" in ln]
    assert len(lines) == 1 and f"{folder} is writable by group" in lines[0], proc.stderr[-2000:]
    assert "IncompatibleOpError" in proc.stderr


OLD_SETUPTOOLS = '''
__version__ = "65.5.0"


def setup(**kwargs):  # what a setuptools before 70.1 without the wheel package ends with under pip
    raise SystemExit("error: invalid command 'bdist_wheel'")
'''


def test_old_setuptools_fails_early_with_the_fix(tmp_path: Path) -> None:
    src = _copy_project(tmp_path / "src")
    fake = tmp_path / "old-tools" / "setuptools"
    (fake / "command").mkdir(parents=True)
    (fake / "__init__.py").write_text(OLD_SETUPTOOLS)
    (fake / "command" / "__init__.py").write_text("")
    code = (
        f"import sys, runpy\nsys.path.insert(0, {str(fake.parent)!r})\nsys.modules['wheel'] = None\n"
        "sys.argv = ['setup.py', 'dist_info']\nrunpy.run_path('setup.py', run_name='__main__')\n"
    )
    proc = _run([sys.executable, "-c", code], src, _clean_env())
    assert proc.returncode != 0
    assert "setuptools 65.5.0" in proc.stderr and "the wheel package is missing" in proc.stderr, proc.stderr
    assert 'pip install "setuptools>=64" wheel' in proc.stderr and sys.executable in proc.stderr


def test_a_builders_own_build_var_asks_for_its_prebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    """``BUILD_VAR`` (DeepSpeed's name for it) is the variable the prebuild reads: a built-in builder that names
    another variable is asked for by that one, and the default name then is an unknown variable."""
    from opbuilder.builders.relu import ReluBuilder
    from opbuilder.jit import prebuild, registry

    monkeypatch.setattr(ReluBuilder, "BUILD_VAR", "OPB_BUILD_MY_RELU")
    monkeypatch.setattr(registry, "_INSTANCES", {})
    for name in [n for n in os.environ if n.startswith("OPB_BUILD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OPB_BUILD_MY_RELU", "1")
    assert prebuild.requested() == (False, {"relu": True})
    monkeypatch.delenv("OPB_BUILD_MY_RELU")
    monkeypatch.setenv("OPB_BUILD_RELU", "1")
    with pytest.raises(prebuild.PrebuildError, match="OPB_BUILD_RELU names no built-in op; the variables are .*OPB_BUILD_MY_RELU"):
        prebuild.requested()
