"""Compiling one build with ninja: incremental, from a snapshot, with nothing slow around the compiler.

Each op and set of compile settings (flags, compilers, torch ABI, archs: everything in the key but the
files) has a work folder ``<root>/.work/<op>-<id>/`` kept across keys and processes, so ninja recompiles
only the translation units whose inputs changed and an edit costs one compile and a link.

The compiler never reads the user's files directly: they are copied first into ``src/`` of the work
folder, mirroring their absolute paths so that relative includes resolve as they would in place. A copy
is rewritten only when its bytes differ, so an unchanged file keeps its time stamp and its object, and
each copied file is checked against the digest the key was computed from: a file saved while a build
runs can never end up in a binary published under another key (``SourcesChanged``).

After the build, the compiler's own dependency records are read: a header it read that lies outside
the snapshot and outside torch, CUDA, Python and the system (reached by ``#include MACRO``, ``CPATH``,
a ``-I`` of the user's flags) is remembered per op and hashed into later keys.

The build namespace (``opb_<op>_<key12>``) lives in one generated translation unit, not in a flag, so a
new key does not recompile every file. ninja runs in a session of its own, under a launcher that asks
the kernel to end it with this process; a build killed by a signal, or interrupted, ends every compiler
it started.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from opbuilder import cache, env, fingerprint, toolchain
from opbuilder.errors import BuildError, CacheError

GEN_DIR = "gen"
SLOTS_DIR = ".slots"
_SLOT_SCRIPT = str(Path(__file__).with_name("_slot.py"))
SRC_DIR = "src"
_MARKER = ".building"
_NAMESPACE_TU = "opb_namespace.cpp"

# Started with -I -S: no current folder, no PYTHONPATH, no site: nothing of the caller's is imported.
# It arranges to be sent SIGTERM when the building thread's process dies, then becomes ninja.
_LAUNCHER = (
    "import ctypes, os, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 15, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(125)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class SourcesChanged(Exception):
    """The files a key was computed from changed before the compiler read them, or the compiler read
    headers that the key did not cover: the caller computes the key again and builds that."""


@dataclass
class Result:
    artifact: Path
    compiled: list[str]  # the translation units that were compiled (file names)
    total: int  # translation units in the build
    log: str


WORK_ROOT = ".work"


def work_dir(op: str, inputs: dict) -> Path:
    """The work folder of everything in ``inputs`` but the files' contents:
    ``<root>/.work/<op>-<hash>/`` (beside the ops' folders, so it is never taken for a build)."""
    settings = {k: v for k, v in inputs.items() if k not in ("files", "discovered", "builder_version")}
    settings["sources"] = sorted(inputs.get("files", {}))
    if env.trust_shared_cache():  # objects are private to each user, even in a shared cache
        settings["uid"] = os.getuid()
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return env.cache_root() / WORK_ROOT / f"{op}-{digest}"


def snapshot_path(work: Path, original: str | Path) -> Path:
    return work / SRC_DIR / os.path.normpath(os.path.abspath(original)).lstrip(os.sep)


def original_text(work: Path, text: str) -> str:
    """Paths into the snapshot written back as the user's own paths (error messages, compile_commands)."""
    return text.replace(str(work / SRC_DIR), "")


# ---- cores shared between builds -------------------------------------------------------------------

_ACTIVE_LOCK = threading.Lock()
_ACTIVE: dict[int, subprocess.Popen] = {}  # launcher pid -> process, for cancel_all()
_CANCELLED = threading.Event()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _slots() -> int:
    """How many compilers may run at once on this machine, over all the builds sharing the cache:
    OPB_MAX_JOBS, else the cores this process may use. Each ninja may start that many jobs; the slot
    files (``opbuilder._slot``) keep the total to it, so ops building at once share the cores."""
    explicit = env.max_jobs()
    return explicit if explicit is not None else _cores()


def _slot_prefix() -> str:
    return " ".join(shlex.quote(part) for part in (sys.executable, "-I", "-S", _SLOT_SCRIPT)) + " "


def _compiler_command(compiler: str) -> str:
    """The build file's command for ``compiler``: through the slot script (see ``opbuilder._slot``)."""
    return _slot_prefix() + shlex.quote(compiler)


def cancel_all() -> None:
    """End every build this process is running (Ctrl-C, SIGTERM): their compilers too; none publishes."""
    _CANCELLED.set()
    with _ACTIVE_LOCK:
        procs = list(_ACTIVE.values())
    for proc in procs:
        _end_session(proc.pid)


def reset_cancel() -> None:
    _CANCELLED.clear()


def raise_if_cancelled() -> None:
    if _CANCELLED.is_set():
        raise KeyboardInterrupt


def _end_session(sid: int) -> None:
    """SIGKILL every process of the session ``sid`` (ninja gives each compiler a process group of its
    own, so ending one group is not enough; the session holds them all)."""
    victims = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if len(fields) > 3 and int(fields[3]) == sid:  # field 6 of stat: the session id
                victims.append(int(entry))
    if not victims:
        with contextlib.suppress(OSError):
            os.killpg(sid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# ---- the work folder ---------------------------------------------------------------------------


def _write_if_changed(path: Path, data: bytes) -> bool:
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def _snapshot(spec, work: Path) -> None:
    """Copy the project files into ``work/src``, checking each against the key's digest."""
    roots = [Path(r) for r in spec.digest_roots]
    wanted: set[Path] = set()
    digests = spec.inputs.get("files", {})
    for original in spec.project_files:
        path = Path(original)
        name = fingerprint.digest_name(path, roots)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SourcesChanged(f"{original} cannot be read ({exc.strerror})") from None
        if hashlib.sha256(data).hexdigest() != digests.get(name):
            raise SourcesChanged(f"{original} changed")
        dest = snapshot_path(work, original)
        _write_if_changed(dest, data)
        wanted.add(dest)
    # A file that left the project must not be found by a later compile.
    for dirpath, _dirs, files in os.walk(work / SRC_DIR):
        for file in files:
            path = Path(dirpath) / file
            if path not in wanted:
                path.unlink()


def _namespace_source(namespace: str) -> bytes:
    return (
        "// Generated by opbuilder: the build's Torch namespace, read by <opbuilder/library.h>.\n"
        f'extern "C" __attribute__((visibility("hidden"))) const char* opb_build_namespace() {{ return "{namespace}"; }}\n'
    ).encode()


def _refuse_foreign(work: Path) -> None:
    """Objects in the work folder are linked into a library this process loads: the folder and its
    parent must be this user's (or root's) and writable by no one else, unless the cache is shared on purpose."""
    if env.trust_shared_cache():
        return
    for path in (work.parent, work):
        st = path.lstat()
        if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode):
            raise CacheError(
                f"opbuilder: refusing to build in {path}: it is not a private folder of this user (owner uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}), so another user could plant objects that would be "
                "linked into an op. Remove it, or set OPB_TRUST_SHARED_CACHE=1 for a cache shared on purpose."
            )


def _clear_interrupted(work: Path) -> None:
    """A build that died mid-compile may have left truncated objects: remove every object written
    since it started, so that none of them is linked as if it were whole."""
    marker = work / _MARKER
    try:
        since = marker.stat().st_mtime_ns
    except FileNotFoundError:
        return
    for obj in work.glob("*.o"):
        with contextlib.suppress(OSError):
            if obj.stat().st_mtime_ns >= since:
                obj.unlink()
    for so in work.glob("*.so"):
        with contextlib.suppress(OSError):
            so.unlink()


# What torch.utils.cpp_extension reads from the environment when it writes a build file.
_CPP_EXTENSION_ENV = ("CXX", "CC", "PYTORCH_NVCC", "CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST",
                      "TORCH_EXTENSION_SKIP_NVCC_GEN_DEPENDENCIES", "TORCH_DONT_CHECK_COMPILER_ABI")


def write_ninja(spec, work: Path) -> Path:
    """Snapshot the sources and write ``work/build.ninja`` through torch.utils.cpp_extension.

    The file is generated again only when what it is made from changed (the arguments, torch, the
    variables cpp_extension reads): importing cpp_extension costs a large part of a small rebuild.
    """
    import torch

    _snapshot(spec, work)
    gen = work / GEN_DIR
    _write_if_changed(gen / _NAMESPACE_TU, _namespace_source(spec.namespace))
    sources = [str(snapshot_path(work, s)) for s in spec.sources] + [str(gen / _NAMESPACE_TU)]
    includes = [str(snapshot_path(work, p)) for p in spec.include_paths]
    # Headers no include path predicts are still found where they are (and then keyed: _discover).
    originals = list(dict.fromkeys([*spec.include_paths, *(os.path.dirname(s) for s in spec.sources)]))
    fallback = [f"-idirafter{d}" for d in originals]
    # nvcc has no -idirafter; its -I here come after the snapshot's (cpp_extension puts those first).
    cuda_fallback = [f"-I{d}" for d in originals]
    cxx = toolchain.cxx_path()
    nvcc = toolchain.nvcc_path() if spec.with_cuda else None
    made_from = json.dumps([spec.name, sources, includes, fallback, cuda_fallback, spec.cxx_args, spec.nvcc_args, spec.ldflags,
                            spec.with_cuda, cxx, nvcc, sys.executable, _SLOT_SCRIPT, torch.__version__, torch.__file__,
                            {k: os.environ.get(k) for k in _CPP_EXTENSION_ENV}], sort_keys=True)
    memo = work / "build.ninja.from"
    target = work / "build.ninja"
    with contextlib.suppress(OSError):
        if target.is_file() and memo.read_text() == made_from:
            return target
    cpp = toolchain.cpp_extension(cuda=spec.with_cuda)
    ldflags = cpp._prepare_ldflags(list(spec.ldflags), spec.with_cuda, False, False, False)
    draft = work / "build.ninja.draft"
    cpp._write_ninja_file_to_build_library(
        path=str(draft), name=spec.name, sources=sources, extra_cflags=[*spec.cxx_args, *fallback],
        extra_cuda_cflags=[*spec.nvcc_args, *cuda_fallback], extra_sycl_cflags=[], extra_ldflags=ldflags,
        extra_include_paths=includes, with_cuda=spec.with_cuda, with_sycl=False, is_standalone=False,
    )
    text = draft.read_text()
    # Run exactly the compilers the key names (cpp_extension re-reads CXX itself), each in a slot.
    if cxx:
        text = re.sub(r"^cxx = .*$", lambda _m: f"cxx = {_compiler_command(cxx)}", text, count=1, flags=re.MULTILINE)
    if nvcc:
        text = re.sub(r"^nvcc = .*$", lambda _m: f"nvcc = {_compiler_command(nvcc)}", text, count=1, flags=re.MULTILINE)
    _write_if_changed(target, text.encode())
    draft.unlink()
    memo.write_text(made_from)
    return target


# ---- running ninja ---------------------------------------------------------------------------------

_STATUS = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")
_SOURCE = re.compile(r" -c (\S+)")


def _ninja() -> str:
    found = shutil.which("ninja")
    if found is None:
        with contextlib.suppress(ImportError):
            import ninja  # the pip package ships the binary

            candidate = os.path.join(ninja.BIN_DIR, "ninja")
            if os.path.isfile(candidate):
                found = candidate
    if found is None:
        raise BuildError("opbuilder: ninja not found: `pip install ninja` (torch.utils.cpp_extension builds with it)")
    return found


def build(spec, say) -> Result:
    """Compile ``spec`` in its work folder; return the linked library (still in the work folder:
    the caller copies it before releasing the work lock) and which files were compiled.

    Call with the work lock held (``work_lock``). Raises SourcesChanged, BuildError, CacheError.
    """
    work = cache.ensure_dir(work_dir(spec.op, spec.inputs))
    _refuse_foreign(work)
    _clear_interrupted(work)
    (work / _MARKER).write_text(str(os.getpid()))
    write_ninja(spec, work)
    code, log, compiled, total = _run_ninja(spec, work, say)
    if code < 0:
        raise BuildError(_killed_message(spec, -code, log))
    if code != 0:
        # ninja exited by itself: it removed what it had not finished, the objects left are whole.
        (work / _MARKER).unlink()
        raise CompileFailed(original_text(work, log))
    (work / _MARKER).unlink()  # every object is whole: a re-key below must reuse them
    _discover(spec, work)
    return Result(work / f"{spec.name}.so", compiled, total, original_text(work, log))


class CompileFailed(Exception):
    """The compiler (or the linker) reported an error; args[0] is the log."""


def _killed_message(spec, signum: int, log: str) -> str:
    name = signal.Signals(signum).name if signum in signal.Signals.__members__.values() else str(signum)
    hint = " (likely out of memory: the kernel's OOM killer sends SIGKILL)" if signum == signal.SIGKILL else ""
    return (
        f"opbuilder: building op {spec.op!r} was killed by signal {signum} ({name}){hint}; its compilers were "
        "ended and nothing was published. Build again, with fewer parallel jobs (OPB_MAX_JOBS=1) if memory is short."
    )


def _run_ninja(spec, work: Path, say) -> tuple[int, str, list[str], int]:
    raise_if_cancelled()
    slots = _slots()
    folder = env.cache_root() / SLOTS_DIR
    with contextlib.suppress(OSError):
        folder.mkdir(exist_ok=True)
    cmd = [_ninja(), "-C", str(work), "-j", str(slots)] + (["-v"] if env.verbose() else [])
    run_env = env.subprocess_env({"NINJA_STATUS": "[%f/%t] ", "OPB_SLOTS": f"{folder}:{slots}"})
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *cmd],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        cwd=str(work), env=run_env, text=True, errors="replace",
    )
    with _ACTIVE_LOCK:
        _ACTIVE[proc.pid] = proc
    lines: list[str] = []
    compiled: list[str] = []
    total = len(spec.sources)
    started = time.monotonic()
    shown = 0
    terminal = sys.stderr.isatty()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            match = _STATUS.match(line)
            if match:
                source = _SOURCE.search(match.group(3))
                if source and not source.group(1).endswith(_NAMESPACE_TU):
                    compiled.append(os.path.basename(source.group(1)))
                if terminal and time.monotonic() - started > 2.0 and source:
                    for name in compiled[shown:]:
                        shown += 1
                        say(f"  [{shown}/{total}] {spec.op}: {name}")
            elif env.verbose():
                sys.stderr.write(original_text(work, line))
        code = proc.wait()
    except BaseException:
        _end_session(proc.pid)
        proc.wait()
        raise
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.pop(proc.pid, None)
    if code != 0 or _CANCELLED.is_set():
        _end_session(proc.pid)  # compilers ninja could not end (ninja itself killed) go too
    if _CANCELLED.is_set():
        raise KeyboardInterrupt
    return code, "".join(lines), compiled, total


# ---- headers the key did not predict ---------------------------------------------------------------


def _covered_roots() -> list[str]:
    """Folders whose headers the key covers by version instead of by content."""
    import sysconfig

    import torch

    roots = [os.path.dirname(torch.__file__), "/usr/include", "/usr/lib", "/usr/lib64", "/usr/local/cuda",
             sysconfig.get_paths().get("include", ""), sysconfig.get_paths().get("platinclude", ""),
             *toolchain.compiler_search_dirs()]
    home = toolchain.cuda_home()
    if home:
        roots.append(home)
    for spec_root in ("nvidia",):
        with contextlib.suppress(ImportError, AttributeError, TypeError):
            import importlib.util

            found = importlib.util.find_spec(spec_root)
            roots += list(found.submodule_search_locations or []) if found else []
    return [os.path.realpath(r) + os.sep for r in roots if r]


def _discover(spec, work: Path) -> None:
    """Remember the headers the compiler read outside the snapshot and outside torch/CUDA/system
    folders; if the key did not cover one, raise SourcesChanged so that the caller keys it."""
    out = subprocess.run([_ninja(), "-C", str(work), "-t", "deps"], capture_output=True, text=True, errors="replace")
    if out.returncode != 0:
        return
    inside = (str(work) + os.sep,)
    covered = tuple(_covered_roots())
    found: set[str] = set()
    for line in out.stdout.splitlines():
        if not line.startswith(" "):
            continue
        path = os.path.abspath(os.path.join(str(work), line.strip()))
        if path.startswith(inside) or os.path.realpath(path).startswith(covered):
            continue
        found.add(path)
    if not found:
        return
    known = set(fingerprint.discovered_files(spec.op))
    keyed = set((spec.inputs.get("discovered") or {}))
    if found <= keyed:
        return
    record = cache.Slot(spec.op, spec.key).op_dir / fingerprint.DISCOVERED
    cache.write_text_atomic(record, json.dumps({"files": sorted(known | found)}, indent=1))
    raise SourcesChanged("it read headers outside its include paths: " + ", ".join(sorted(found - keyed)[:3]))


def compile_commands(spec) -> list[dict]:
    """The compile commands of ``spec`` (clangd's compile_commands.json), with the user's own paths."""
    work = cache.ensure_dir(work_dir(spec.op, spec.inputs))
    write_ninja(spec, work)
    out = subprocess.run([_ninja(), "-C", str(work), "-t", "compdb", "compile", "cuda_compile"],
                         capture_output=True, text=True, check=True)
    entries = json.loads(original_text(work, out.stdout))
    for entry in entries:  # clangd wants the compiler first, not the slot script
        entry["command"] = entry.get("command", "").replace(_slot_prefix(), "", 1)
    return [e for e in entries if not e.get("file", "").endswith(_NAMESPACE_TU)]


__all__ = ["SourcesChanged", "Result", "build", "cancel_all", "compile_commands", "work_dir", "CacheError"]
