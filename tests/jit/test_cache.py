"""The JIT cache: warm loads do not rebuild, the key follows the content, concurrent and killed
builds are safe, damaged artifacts are rebuilt, and failures carry the compiler's words."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT, copy_cache, run_python
from helpers import cache as built
from helpers.userop import load_snippet, write_user_op


def test_a_relative_cache_folder_is_taken_from_the_working_folder(tmp_path: Path) -> None:
    """OPB_CACHE_DIR=build/cache (relative) builds: ninja runs in the op's work folder, which must not be
    looked up again from there (it was: "ninja: fatal: chdir to 'build/cache/.work/...'")."""
    op = write_user_op(tmp_path / "proj")
    relative = os.path.relpath(tmp_path / "rel-cache", ROOT)  # the loading process runs in ROOT
    result = built.load(op, OPB_CACHE_DIR=relative)
    assert result.returncode == 0, result.stderr
    assert "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in result.stdout
    built.manifest(tmp_path / "rel-cache")  # its one build, where the relative path names


def test_warm_load_does_not_rebuild(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    first = built.load(op)
    assert first.returncode == 0, first.stderr
    assert "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in first.stdout
    assert built.builds(first) == 1
    build_dir, manifest = built.manifest(fresh_cache)
    so_mtime = (build_dir / manifest["artifact"]).stat().st_mtime_ns

    second = built.load(op)
    assert second.returncode == 0, second.stderr
    assert "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in second.stdout
    assert second.stderr == "", "a cache hit must print nothing"
    _, again = built.manifest(fresh_cache)
    assert again["build_id"] == manifest["build_id"]
    assert (build_dir / manifest["artifact"]).stat().st_mtime_ns == so_mtime


def test_warm_load_uses_no_compiler_no_lock(built_user_op: tuple[Path, Path], fresh_cache: Path) -> None:
    op = built_user_op[0]
    copy_cache(built_user_op[1], fresh_cache)
    probe = load_snippet(op) + (
        "\nimport sys\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'warm load imported cpp_extension'\n"
        "assert 'filelock' not in sys.modules or not any(\n"
        "    'opbuilder' in repr(getattr(m, '__file__', '')) for m in [])\n"
    )
    # Make taking any file lock fail loudly in the warm process.
    probe = "import filelock\nfilelock.FileLock.acquire = lambda *a, **k: (_ for _ in ()).throw(RuntimeError('lock taken'))\n" + probe
    result = run_python(probe)
    assert result.returncode == 0, result.stderr


def test_key_follows_sources_headers_and_flags(tmp_path: Path) -> None:
    sys.path.insert(0, str(write_user_op(tmp_path / "proj")))
    try:
        from my_ops import AddScaleBuilder

        base = AddScaleBuilder().key
        (tmp_path / "proj/csrc/scale.h").write_text("#pragma once\nconstexpr float kScale = 3.0;\n")
        header_changed = AddScaleBuilder().key
        write_user_op(tmp_path / "proj", offset=2.0)
        source_changed = AddScaleBuilder().key

        class WithFlag(AddScaleBuilder):
            def cxx_args(self) -> list[str]:
                return super().cxx_args() + ["-DEXTRA=1"]

        flag_changed = WithFlag().key
        write_user_op(tmp_path / "proj")
        assert AddScaleBuilder().key == base, "reverting the files must give back the same key"
        assert len({base, header_changed, source_changed, flag_changed}) == 4
    finally:
        sys.path.remove(str(tmp_path / "proj"))
        sys.modules.pop("my_ops", None)


def test_header_edit_rebuilds_and_revert_reuses(built_user_op: tuple[Path, Path], tmp_path: Path,
                                                 fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj", scale=2.0)  # the built op's files: its build is in the copied cache
    copy_cache(built_user_op[1], fresh_cache)
    write_user_op(op, scale=3.0)
    edited = built.load(op)
    assert built.builds(edited) == 1 and "RESULT [1.0, 4.0, 7.0, 10.0, 13.0]" in edited.stdout
    write_user_op(op, scale=2.0)
    reverted = built.load(op)
    assert reverted.returncode == 0, reverted.stderr
    assert built.builds(reverted) == 0, "the old build must be reused"
    assert "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in reverted.stdout


def test_two_processes_build_once(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    env = dict(os.environ)
    procs = [
        subprocess.Popen([sys.executable, "-c", load_snippet(op)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all("RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in out for out, _ in outs)
    assert sum(err.count("opbuilder: building ") for _, err in outs) == 1


def test_killed_build_leaves_no_poison(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    proc = subprocess.Popen([sys.executable, "-c", load_snippet(op)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    op_dir = fresh_cache / "add_scale"
    # Wait until the compiler is running in the cache (the op's work folder), then kill the loader.
    assert built.wait_for(lambda: bool(built.build_processes(op / "csrc", fresh_cache)), 120), "the build never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # ninja dies with its loader (parent-death signal) and ends its compilers at once.
    assert built.wait_for(lambda: not built.build_processes(op / "csrc", fresh_cache), 3), built.build_processes(op / "csrc", fresh_cache)
    # A zero lock timeout proves the next load does not wait for the dead builder's lock.
    result = built.load(op, OPB_LOCK_TIMEOUT="0")
    assert result.returncode == 0, result.stderr
    assert "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in result.stdout
    assert not list(op_dir.glob(".tmp-*")), "the stray temporary folder must be removed"


def test_truncated_artifact_is_rebuilt(built_user_op: tuple[Path, Path], fresh_cache: Path) -> None:
    op = built_user_op[0]
    copy_cache(built_user_op[1], fresh_cache)
    build_dir, manifest = built.manifest(fresh_cache)
    artifact = build_dir / manifest["artifact"]
    artifact.write_bytes(artifact.read_bytes()[:1000])
    result = built.load(op)
    assert result.returncode == 0, result.stderr
    assert built.builds(result) == 1
    assert "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in result.stdout


def test_garbage_artifact_of_the_same_size_is_rebuilt(built_user_op: tuple[Path, Path], fresh_cache: Path) -> None:
    op = built_user_op[0]
    copy_cache(built_user_op[1], fresh_cache)
    build_dir, manifest = built.manifest(fresh_cache)
    artifact = build_dir / manifest["artifact"]
    artifact.write_bytes(b"\0" * manifest["artifact_size"])
    result = built.load(op)
    assert result.returncode == 0, result.stderr
    assert built.builds(result) == 1


def test_failed_build_reports_compiler_error_here_and_in_waiter(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj", broken=True)
    procs = [
        subprocess.Popen([sys.executable, "-c", load_snippet(op)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode != 0
        assert "BuildError" in err, err
        assert "add_scale.cpp" in err and "error:" in err, err
        assert "ImportError" not in err and "cannot open shared object" not in err
    # Nothing that looks like a build is left in the cache.
    assert not [p for p in (fresh_cache / "add_scale").iterdir() if p.is_dir()]


CLEAN_AFTER_BUILD = """
import subprocess, sys
from opbuilder.jit import build
real_ensure_built = build.ensure_built
cleaned = []
def ensure_built_then_clean(spec, **kwargs):
    path = real_ensure_built(spec, **kwargs)  # built, published, the lock released
    if not cleaned:
        cleaned.append(subprocess.run([sys.executable, "-m", "opbuilder", "clean", spec.op], check=True))
    return path
build.ensure_built = ensure_built_then_clean
"""


def test_clean_between_build_and_load_is_not_a_build_error(tmp_path: Path, fresh_cache: Path) -> None:
    op = write_user_op(tmp_path / "proj")
    result = run_python(CLEAN_AFTER_BUILD + load_snippet(op))
    assert result.returncode == 0 and "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]" in result.stdout, result.stderr[-2000:]


def test_cache_folder_name_too_long_is_a_cache_error(tmp_path: Path, monkeypatch) -> None:
    """A cache root whose name the filesystem refuses (ENAMETOOLONG) is a CacheError naming OPB_CACHE_DIR on the
    warm path, where the check for an existing build raised the bare OSError."""
    import pytest

    from opbuilder.errors import CacheError
    from opbuilder.jit import loader

    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / ("a" * 300)))
    with pytest.raises(CacheError, match="OPB_CACHE_DIR") as info:
        loader.load_cached("add_scale", "0" * 20)
    assert "File name too long" in str(info.value)
    assert "cache folder" in str(info.value) and "cache file" not in str(info.value), str(info.value)  # not there: named a folder all the same


def test_a_cache_error_names_a_file_as_a_file(tmp_path: Path, monkeypatch) -> None:
    """A full disk, or a file the user may not write, met on a file of the cache: the message named the file
    "the cache folder <file>", which sends the reader to look for a folder of that name."""
    import errno

    from opbuilder.jit import cache

    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path))
    folder, file = tmp_path / "relu", tmp_path / "relu" / "k.failed.json"
    folder.mkdir()
    for shared in ("0", "1"):
        monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", shared)
        for code in (errno.ENOSPC, errno.EACCES, errno.EROFS):
            on_file = str(cache.cache_error(file, OSError(code, os.strerror(code))))
            on_folder = str(cache.cache_error(folder, OSError(code, os.strerror(code))))
            assert f"folder {file}" not in on_file and (f"file {file}:" in on_file or f"writing {file} (" in on_file), on_file
            assert f"folder {folder}" in on_folder and os.strerror(code) in on_folder, on_folder
            assert "OPB_CACHE_DIR" in on_file and "OPB_CACHE_DIR" in on_folder


def test_a_folder_that_cannot_be_made_is_named_a_folder(tmp_path: Path, monkeypatch) -> None:
    """A cache folder that cannot be made (a read-only or full disk, a parent not this user's) does not exist
    when the error is reported: it was named "the cache file <folder>", as a file would be."""
    import errno

    import pytest

    from opbuilder.errors import CacheError
    from opbuilder.jit import cache

    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "relu"
    for shared in ("0", "1"):
        monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", shared)
        for code in (errno.EROFS, errno.EACCES, errno.ENOSPC):
            def refuse(self, *args, code=code, **kwargs):
                raise OSError(code, os.strerror(code))

            with monkeypatch.context() as m:
                m.setattr(Path, "mkdir", refuse)
                with pytest.raises(CacheError) as info:
                    cache.ensure_dir(folder)
            message = str(info.value)
            assert f"folder {folder}" in message and os.strerror(code) in message, message
            assert "file" not in message.replace("file system", ""), message


LOAD_AFTER_FAILED_INIT = r"""
import sys
from pathlib import Path
from opbuilder.jit import cache, loader
here = Path(sys.argv[1] if len(sys.argv) > 1 else {folder!r})
def manifest(name):
    return {{"python_module": True, "module_name": name, **cache.describe_artifact(here / f"{{name}}.so")}}
try:
    loader.load_artifact("bad", "k1", here / "bad.so", manifest("bad"))
except ImportError as exc:
    print("BAD", exc)
print("GOOD", loader.load_artifact("good", "k2", here / "good.so", manifest("good")).VALUE)
"""


def test_a_library_after_one_whose_init_failed_is_loaded_itself(tmp_path: Path) -> None:
    """A module whose init raised stays mapped under the name /proc/self/fd/N; with N closed and reused, the next
    library loaded (a rebuild, the JIT build after a prebuilt one failed) was never loaded: the dynamic loader
    handed back the failed one ("dynamic module does not define module export function (PyInit_good)")."""
    import sysconfig

    (tmp_path / "bad.c").write_text(
        "#include <Python.h>\n"
        'PyMODINIT_FUNC PyInit_bad(void) { PyErr_SetString(PyExc_ImportError, "init failed on purpose"); return NULL; }\n')
    (tmp_path / "good.c").write_text(
        "#include <Python.h>\n"
        'static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "good", NULL, -1, NULL};\n'
        "PyMODINIT_FUNC PyInit_good(void) {\n"
        "  PyObject* m = PyModule_Create(&def); PyModule_AddIntConstant(m, \"VALUE\", 42); return m;\n}\n")
    for name in ("bad", "good"):
        subprocess.run(["cc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", f"{name}.c", "-o", f"{name}.so"],
                       cwd=tmp_path, check=True)
    result = run_python(LOAD_AFTER_FAILED_INIT.format(folder=str(tmp_path)))
    assert "BAD init failed on purpose" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "GOOD 42" in result.stdout, result.stderr[-2000:]
