"""Incremental rebuilds, snapshots and what a build prints (the build-speed and reliability issues).

Each test builds a tiny two-file op (tests/helpers/twofile.py) into a fresh cache; a build reads the log it
publishes to tell which files were compiled.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers import HELPERS, ROOT, default_sigint, run_python, twofile
from opbuilder.jit import cache, compile, toolchain
from opbuilder.errors import BuildError

X = torch.arange(3, dtype=torch.float32)


def compiled_files(builder) -> list[str]:
    """The translation units the published build of ``builder``'s key compiled (from its build log)."""
    log = (cache.Slot(builder.name, builder.key).path / cache.LOG).read_text()
    return sorted(os.path.basename(m) for m in re.findall(r" -c (\S+)", log) if not m.endswith("opb_namespace.cpp"))


def test_edit_one_file_compiles_one_and_revert_compiles_none(tmp_path: Path, fresh_cache: Path, capfd) -> None:
    root = twofile.write_op(tmp_path / "proj", name="inc_edit")
    first = twofile.builder(root)
    assert first.load().inc_edit(X).tolist() == [0, 2, 4]
    assert compiled_files(first) == ["binding.cpp", "kernel.cpp"]

    twofile.set_kernel(root, "3")
    edited = twofile.builder(root)
    assert edited.key != first.key
    assert edited.load().inc_edit(X).tolist() == [0, 3, 6]
    assert compiled_files(edited) == ["kernel.cpp"], "only the edited file is compiled"
    err = capfd.readouterr().err
    assert "building inc_edit (cpu): kernel.cpp changed" in err
    assert re.search(r"built inc_edit in [\d.]+ s \(1 of 2 files compiled\)", err)

    twofile.set_kernel(root, "2")
    reverted = twofile.builder(root)
    assert reverted.key == first.key
    assert reverted.load().inc_edit(X).tolist() == [0, 2, 4]
    assert capfd.readouterr().err == "", "a cache hit prints nothing and compiles nothing"


def test_objects_are_reused_across_processes(tmp_path: Path, fresh_cache: Path) -> None:
    root = twofile.write_op(tmp_path / "proj", name="inc_proc")
    assert twofile.builder(root).load().inc_proc(X).tolist() == [0, 2, 4]
    twofile.set_kernel(root, "5")
    proc = run_python(twofile.run_snippet(root, "inc_proc"))
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [0.0, 5.0, 10.0]" in proc.stdout
    assert "(1 of 2 files compiled)" in proc.stderr


def test_a_header_edit_recompiles_its_includers_only(tmp_path: Path, fresh_cache: Path) -> None:
    root = twofile.write_op(tmp_path / "proj", name="inc_hdr")
    (root / "csrc" / "value.h").write_text("#pragma once\nconstexpr float kValue = 7;\n")
    twofile.set_kernel(root, "kValue", extra='#include "value.h"')
    assert twofile.builder(root).load().inc_hdr(X).tolist() == [0, 7, 14]
    (root / "csrc" / "value.h").write_text("#pragma once\nconstexpr float kValue = 8;\n")
    edited = twofile.builder(root)
    assert edited.load().inc_hdr(X).tolist() == [0, 8, 16]
    assert compiled_files(edited) == ["kernel.cpp"]


def test_a_file_older_than_its_object_is_still_recompiled(tmp_path: Path, fresh_cache: Path) -> None:
    """ninja alone trusts time stamps: a file replaced by an older copy (a checkout, ``cp -p``) would keep
    the stale object. The snapshot compares bytes."""
    root = twofile.write_op(tmp_path / "proj", name="inc_old")
    twofile.builder(root).load()
    kernel = root / "csrc" / "kernel.cpp"
    twofile.set_kernel(root, "4")
    os.utime(kernel, (1_000_000_000, 1_000_000_000))  # 2001
    assert twofile.builder(root).load().inc_old(X).tolist() == [0, 4, 8]


def _wrapper(tmp_path: Path, body: str) -> Path:
    """A compiler wrapper (CXX) that runs ``body`` (bash) before the real compiler when it compiles kernel.cpp."""
    real = toolchain.cxx_path()
    script = tmp_path / "wrap-cxx"
    script.write_text(f'#!/bin/bash\nfor a in "$@"; do\nif [[ "$a" == */kernel.cpp ]]; then\n{body}\nfi\ndone\n'
                      f'exec {real} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_a_source_saved_during_the_build_is_not_published_under_the_old_key(
        tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = twofile.write_op(tmp_path / "proj", name="inc_race")
    kernel = root / "csrc" / "kernel.cpp"
    flag = tmp_path / "edit-now"
    # The "user" saves an edit (x * 9) while the compiler runs, once.
    wrapper = _wrapper(tmp_path, f'if [ -e {flag} ]; then rm {flag}; sed -i "s/\\* 2;/* 9;/" {kernel}; fi')
    monkeypatch.setenv("CXX", str(wrapper))
    flag.touch()
    old = twofile.builder(root)
    assert old.load().inc_race(X).tolist() == [0, 2, 4], "the binary under the old key is the old source's"
    assert "* 9;" in kernel.read_text()
    assert twofile.builder(root).load().inc_race(X).tolist() == [0, 9, 18]
    twofile.set_kernel(root, "2")  # revert: the old key, and the old source's binary
    reverted = twofile.builder(root)
    assert reverted.key == old.key
    proc = run_python(twofile.run_snippet(root, "inc_race"), env={"CXX": str(wrapper)})
    assert "RESULT [0.0, 2.0, 4.0]" in proc.stdout, proc.stdout + proc.stderr


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_a_build_killed_by_a_signal_ends_its_compilers_and_links_no_truncated_object(
        tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the OOM killer would: ninja gets SIGKILL while a compiler runs and has half-written its object."""
    root = twofile.write_op(tmp_path / "proj", name="inc_kill")
    poison = tmp_path / "poison"
    marker = f"opb-sleeper-{os.getpid()}"
    wrapper = _wrapper(tmp_path, textwrap.dedent(f"""\
        if [ -e {poison} ]; then
          out=""; prev=""; for b in "$@"; do [ "$prev" = "-o" ] && out="$b"; prev="$b"; done
          printf 'half an object' > "$out"
          p=$PPID; while [ "$(cat /proc/$p/comm)" != ninja ]; do p=$(cut -d" " -f4 /proc/$p/stat); done
          kill -9 $p
          exec -a {marker} sleep 60
        fi"""))
    monkeypatch.setenv("CXX", str(wrapper))
    assert twofile.builder(root).load().inc_kill(X).tolist() == [0, 2, 4]
    twofile.set_kernel(root, "6")
    poison.touch()
    with pytest.raises(BuildError, match=r"killed by signal 9 \(SIGKILL\).*out of memory"):
        twofile.builder(root).load()
    deadline = time.time() + 5
    while _processes_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert not _processes_with(marker), "the compiler of the killed build still runs"
    poison.unlink()
    assert twofile.builder(root).load().inc_kill(X).tolist() == [0, 6, 12]


def test_the_compile_reads_nothing_from_the_callers_folder(tmp_path: Path, fresh_cache: Path) -> None:
    """A build started from a folder holding json.py / ctypes.py / os.py runs none of them, and works when
    opbuilder is on sys.path only at run time (not installed)."""
    planted = tmp_path / "cwd"
    planted.mkdir()
    hit = tmp_path / "planted-ran"
    for module in ("json", "ctypes", "os", "signal", "torch", "opbuilder"):
        (planted / f"{module}.py").write_text(f"open({str(hit)!r}, 'a').write('{module} ')\n")
    root = twofile.write_op(tmp_path / "proj", name="inc_cwd")
    script = tmp_path / "main.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                      + twofile.run_snippet(root, "inc_cwd"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(script)], cwd=planted, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [0.0, 2.0, 4.0]" in proc.stdout
    assert not hit.exists(), f"planted modules ran: {hit.read_text()}"


def test_a_header_outside_the_include_paths_is_keyed(tmp_path: Path, fresh_cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """A header found through CPATH (or -I in the user's flags, or #include MACRO) is hashed once the
    compiler has reported reading it: an edit rebuilds, a revert finds the old build. Keying it again
    links the objects just compiled: nothing is compiled twice."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "cpath_value.h").write_text("#pragma once\nconstexpr float kValue = 3;\n")
    monkeypatch.setenv("CPATH", str(extra))
    root = twofile.write_op(tmp_path / "proj", name="inc_cpath")
    twofile.set_kernel(root, "kValue", extra="#include <cpath_value.h>")
    first = twofile.builder(root)
    assert first.load().inc_cpath(X).tolist() == [0, 3, 6]
    built = [ln for ln in capfd.readouterr().err.splitlines() if "built inc_cpath" in ln or "keying it again" in ln]
    assert len(built) == 2 and "keying it again" in built[0], built
    assert built[1].endswith("(0 of 2 files compiled)"), built
    keyed = twofile.builder(root)
    assert str(extra / "cpath_value.h") in keyed.key_inputs()["discovered"]
    (extra / "cpath_value.h").write_text("#pragma once\nconstexpr float kValue = 4;\n")
    assert twofile.builder(root).load().inc_cpath(X).tolist() == [0, 4, 8]
    (extra / "cpath_value.h").write_text("#pragma once\nconstexpr float kValue = 3;\n")
    again = twofile.builder(root)
    assert again.key == keyed.key


def test_a_renamed_project_keeps_its_key(tmp_path: Path, fresh_cache: Path) -> None:
    a = twofile.write_op(tmp_path / "a", name="inc_move")
    key = twofile.builder(a).key
    b = tmp_path / "renamed"
    a.rename(b)
    assert twofile.builder(b).key == key


def test_a_header_through_a_symlink_is_looked_up_beside_the_link(tmp_path: Path, fresh_cache: Path) -> None:
    root = twofile.write_op(tmp_path / "proj", name="inc_link")
    target_dir = tmp_path / "elsewhere"
    target_dir.mkdir()
    (target_dir / "value.h").write_text('#pragma once\n#include "near.h"\n')
    (target_dir / "near.h").write_text("constexpr float kValue = 1;\n")  # beside the target: not what the compiler reads
    (root / "csrc" / "near.h").write_text("constexpr float kValue = 5;\n")  # beside the link: what it reads
    (root / "csrc" / "value.h").symlink_to(target_dir / "value.h")
    twofile.set_kernel(root, "kValue", extra='#include "value.h"')
    b = twofile.builder(root)
    assert any(name.endswith("csrc/near.h") and "elsewhere" not in name for name in b.key_inputs()["files"])
    assert b.load().inc_link(X).tolist() == [0, 5, 10]


def test_undefined_symbol_is_reported_demangled(tmp_path: Path, fresh_cache: Path) -> None:
    root = twofile.write_op(tmp_path / "proj", name="inc_undef")
    twofile.set_kernel(root, "my_helper_not_defined(n)", extra="float my_helper_not_defined(long n);")
    with pytest.raises(BuildError, match=r"my_helper_not_defined\(long\)") as info:
        twofile.builder(root).load()
    assert "_Z21" not in str(info.value)


def test_debug_builds_have_their_own_key_and_debug_info(tmp_path: Path, fresh_cache: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root = twofile.write_op(tmp_path / "proj", name="inc_debug")
    plain = twofile.builder(root)
    plain_key, plain_args = plain.key, plain.final_cxx_args()
    monkeypatch.setenv("OPB_DEBUG", "1")
    debug = twofile.builder(root)
    assert debug.key != plain_key
    assert "-g" in debug.final_cxx_args() and "-g" not in plain_args
    debug.load()
    artifact = next(cache.Slot("inc_debug", debug.key).path.glob("*.so"))
    sections = subprocess.run(["readelf", "-S", str(artifact)], capture_output=True, text=True).stdout
    assert ".debug_info" in sections
    lines = subprocess.run(["readelf", "--debug-dump=decodedline", str(artifact)], capture_output=True, text=True).stdout
    assert "kernel.cpp" in lines, "line tables name the source"


def test_debug_0_drops_the_debug_flags_an_op_asks_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OPB_DEBUG=0: no debug info even where the op's own flags ask for it (DeepSpeed's CPU builders pass -g;
    without it their builds take about a third less time); an op without such flags keeps its key."""
    from opbuilder import env

    root = twofile.write_op(tmp_path / "proj", name="inc_nodebug")
    plain = twofile.builder(root)

    class Debugged(type(plain)):
        def cxx_args(self) -> list[str]:
            return super().cxx_args() + ["-O2", "-g", "-ggdb3", "-gdwarf-4", "-g0", "-gsplit-dwarf"]

        def nvcc_args(self) -> list[str]:
            return super().nvcc_args() + ["-lineinfo", "-G", "--generate-line-info", "-g", "-O3", "-Xcompiler", "-g",
                                          "-Xcompiler", "-ggdb,-fPIC", "--compiler-options=-g3", "-Xcompiler=-Wall,-g",
                                          "-Xptxas", "-v"]

    asked = Debugged()
    assert "-g" in asked.final_cxx_args() and "-lineinfo" in asked.final_nvcc_args()
    keys = {None: (plain.key, asked.key)}
    for value in ("0", "off"):
        monkeypatch.setenv("OPB_DEBUG", value)
        assert env.debug() == "none"
        cxx, nvcc = Debugged().final_cxx_args(), Debugged().final_nvcc_args()
        assert not {"-g", "-ggdb3", "-gdwarf-4"} & set(cxx), cxx
        assert {"-O2", "-g0", "-gsplit-dwarf"} <= set(cxx), cxx
        assert not {"-lineinfo", "-G", "--generate-line-info", "-g"} & set(nvcc) and "-O3" in nvcc, nvcc
        # the host compiler's debug flags given through -Xcompiler go too, its other flags stay
        assert nvcc[-6:] == ["-O3", "-Xcompiler", "-fPIC", "-Xcompiler=-Wall", "-Xptxas", "-v"], nvcc
        keys[value] = (twofile.builder(root).key, Debugged().key)
    assert keys["0"] == keys["off"]
    assert keys["0"][0] == keys[None][0], "an op without debug flags keeps its key"
    assert keys["0"][1] != keys[None][1], "dropping the op's -g is a build of its own"
    monkeypatch.setenv("OPB_DEBUG", "sometimes")
    with pytest.raises(ValueError, match=r"OPB_DEBUG must be 1 .* or 0 .*got 'sometimes'"):
        env.debug()


def test_compile_commands_name_the_users_own_files(tmp_path: Path, fresh_cache: Path) -> None:
    root = twofile.write_op(tmp_path / "proj", name="inc_cc")
    entries = compile.compile_commands(twofile.builder(root).build_spec())
    files = sorted(e["file"] for e in entries)
    assert files == [str(root / "csrc" / "binding.cpp"), str(root / "csrc" / "kernel.cpp")]
    assert all("-DOPB_STABLE_ABI" in e["command"] for e in entries)
    assert all(str(fresh_cache) not in e["command"].split(" -o ")[0].split(" -c ")[1] for e in entries)


def test_builds_running_at_once_share_the_cores(tmp_path: Path, fresh_cache: Path) -> None:
    """Two processes building two ops on one cache, with 2 compile slots: never more than 2 compilers
    at once (each ninja alone may start 2), and both builds finish."""
    real = toolchain.cxx_path()
    log = tmp_path / "compiles.log"
    slow = tmp_path / "timed-cxx"
    slow.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        case " $* " in *" -c "*) ;; *) exec {real} "$@";; esac
        echo "+ $(date +%s.%N)" >> {log}
        sleep 0.6
        {real} "$@"; code=$?
        echo "- $(date +%s.%N)" >> {log}
        exit $code
    """))
    slow.chmod(0o755)
    roots = [twofile.write_op(tmp_path / f"p{i}", name=f"inc_share{i}") for i in range(2)]
    env = {**os.environ, "CXX": str(slow), "OPB_CACHE_DIR": str(fresh_cache), "OPB_MAX_JOBS": "2"}
    script = "import sys\nsys.path.insert(0, {tests!r})\nimport twofile\nfrom pathlib import Path\n" \
             "print(twofile.builder(Path({root!r})).load())\n"
    procs = [subprocess.Popen([sys.executable, "-c", script.format(tests=str(HELPERS), root=str(r))],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in roots]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    running, most, starts = 0, 0, 0
    events = sorted((float(t), sign) for sign, t in (ln.split() for ln in log.read_text().splitlines()))
    for _, sign in sorted(events, key=lambda e: (e[0], e[1] == "+")):  # an end before a start at the same time
        running += 1 if sign == "+" else -1
        starts += sign == "+"
        most = max(most, running)
    assert starts == 6  # two sources and the namespace unit of each op
    assert most == 2, f"{most} compilers ran at once with 2 slots"


def test_stable_key_names_the_abi_not_the_torch_version(tmp_path: Path, fresh_cache: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    stable = twofile.builder(twofile.write_op(tmp_path / "s", name="inc_abi_s", abi="stable"))
    classic = twofile.builder(twofile.write_op(tmp_path / "c", name="inc_abi_c", abi="classic"))
    assert stable.abi() == "stable" and classic.abi() == "classic"
    assert "-DOPB_STABLE_ABI" in stable.final_cxx_args() and "-DOPB_STABLE_ABI" not in classic.final_cxx_args()
    assert stable.key_inputs()["abi"] == "stable-2.10" and "torch" not in stable.key_inputs()
    keys = (stable.key, classic.key)
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    for version in ("2.11.0", "2.99.0"):  # before and after torch's headers moved to C++20
        monkeypatch.setattr(torch, "__version__", version)
        toolchain.cxx_standard.cache_clear()
        stable.refresh()
        classic.refresh()
        assert stable.key == keys[0], f"a torch {version} within the ABI range keeps a stable op's build"
        assert classic.key != keys[1], "a classic op is keyed by the exact torch"
    toolchain.cxx_standard.cache_clear()


def test_interrupting_opbuilder_build_stops_its_compilers_and_publishes_nothing(
        tmp_path: Path, fresh_cache: Path) -> None:
    marker = f"opb-slowcc-{os.getpid()}"
    real = toolchain.cxx_path()
    slow = tmp_path / "slow-cxx"
    # Compiles take a minute (the identity probes run the real compiler).
    slow.write_text(f'#!/bin/bash\nfor a in "$@"; do [ "$a" = -c ] && exec -a {marker} sleep 60; done\nexec {real} "$@"\n')
    slow.chmod(0o755)
    env = {**os.environ, "CXX": str(slow), "OPB_CACHE_DIR": str(fresh_cache)}
    proc = subprocess.Popen([sys.executable, "-m", "opbuilder", "build", "relu", "softmax"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    deadline = time.time() + 120
    while len(_processes_with(marker)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert len(_processes_with(marker)) >= 2, "both ops should be compiling"
    started = time.time()
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert time.time() - started < 10, "Ctrl-C must stop the command at once"
    assert proc.returncode == 130, err
    assert "interrupted" in err
    time.sleep(0.5)
    assert not _processes_with(marker), "compilers still run after Ctrl-C"
    published = [p for p in fresh_cache.glob("*/*/manifest.json")]
    assert published == [], f"published after Ctrl-C: {published}"


def test_the_compilers_own_headers_are_not_discovered(tmp_path: Path, fresh_cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    """A compiler installed outside /usr (as /opt/gcc on the GPU machine) reads its own headers (stddef.h,
    limits.h) from its own folder: covered by its version in the key, so the build is keyed once."""
    own = tmp_path / "opt-gcc" / "include"
    own.mkdir(parents=True)
    (own / "vendor_builtin.h").write_text("#pragma once\nconstexpr float kValue = 7;\n")
    wrapper = tmp_path / "opt-gcc" / "c++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("c++")} -isystem {own} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    root = twofile.write_op(tmp_path / "proj", name="inc_vendor")
    twofile.set_kernel(root, "kValue", extra="#include <vendor_builtin.h>")
    assert twofile.builder(root).load().inc_vendor(X).tolist() == [0, 7, 14]
    err = capfd.readouterr().err
    assert "keying it again" not in err, err
    assert not twofile.builder(root).key_inputs().get("discovered")
