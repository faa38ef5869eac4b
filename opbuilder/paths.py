"""Every path opbuilder uses: its own files in the package, and every entry inside the cache.

The package::

    opbuilder/include/                  public headers for every op: #include <opbuilder/library.h>
    kernels/                            the built-in ops' sources (inside the package when installed as a wheel)
    opbuilder/_prebuilt/<op>/           a built-in op compiled at install time (opbuilder.jit.prebuild)
    opbuilder/templates/op/             the skeleton `opbuilder new` writes

The cache, under ``root()`` (``OPB_CACHE_DIR``, see ``opbuilder.env.cache_root``)::

    <op>/<key>/                          a published build: the library, manifest.json, build.log
    <op>/<key>.lock                      the build lock of that key (an OS lock: it dies with its holder)
    <op>/<key>.starting.lock             held by a background build of that key (the C++ gradient glue's) from its
                                         start to its end: other processes wait for it rather than start their own
    <op>/<key>.failed.json               the last failed build of that key: its error ...
    <op>/<key>.failed.log                ... and the compiler's whole output
    <op>/.tmp-<key>-<pid>-*/             a build in progress (or a replaced one on its way out); never loaded,
                                         removed when its builder is gone
    <op>/discovered.json                 headers an earlier build read that no include path predicted (part of the key)
    <op>/keymemo-<uid>.json              what the key last read of each file (sha256, includes) and the file's status,
                                         so a warm load stats the files instead of hashing them (one per user, 0600)
    .work/<op>-<hash>/                   one op's objects for one set of flags and compilers, kept across keys:
        src/                             the sources as the build compiled them (a snapshot)
        gen/                             generated translation units (the namespace)
        objects.json                     each object's hash and the hashes of the files it was compiled from
        .building                        present while a build compiles there (objects may be half-written)
    .work/<op>-<hash>.lock               the lock of that work folder
    .slots/                              one flock'ed file per compile slot (the machine's cores)
    compilers.json                       each compiler's --version, asked once per binary
    traces/<op>/<key>.json               opbuilder tune's timings, which dispatch follows
    traces/<op>/<key>.check.json         opbuilder check's statuses
    traces/<op>/<key>.lock               held while a check or tune reads and replaces a trace of that key

Nothing here touches the disk or imports torch; the cache's own rules (modes, trust, atomic writes) are
``opbuilder.jit.cache``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from opbuilder import env

# ---- the package ------------------------------------------------------------------------------------

PACKAGE_DIR = Path(__file__).resolve().parent
#: Public headers for every op: ``#include <opbuilder/library.h>``.
INCLUDE_DIR = PACKAGE_DIR / "include"
#: Sources of the built-in ops: inside the package when installed as a wheel, beside it in a checkout.
KERNELS_DIR = next((p for p in (PACKAGE_DIR / "kernels", PACKAGE_DIR.parent / "kernels") if p.is_dir()), PACKAGE_DIR / "kernels")
#: Built-in ops compiled at install time (see ``opbuilder.jit.prebuilt``): ``<PREBUILT_DIR>/<op>/``.
PREBUILT_DIR = PACKAGE_DIR / "_prebuilt"
#: The skeleton ``opbuilder new`` writes.
TEMPLATE_DIR = PACKAGE_DIR / "templates" / "op"

# ---- the cache --------------------------------------------------------------------------------------

#: Inside a build folder (and a prebuilt op's folder): its record, and the compiler's output.
MANIFEST = "manifest.json"
LOG = "build.log"
#: The prefix of a build in progress, inside ``op_dir``.
TMP_PREFIX = ".tmp-"
#: Inside a work folder.
WORK_SOURCES, WORK_GENERATED, WORK_BUILDING, WORK_OBJECTS = "src", "gen", ".building", "objects.json"


def root() -> Path:
    return env.cache_root()


def op_dir(op: str) -> Path:
    return root() / op


def build_dir(op: str, key: str) -> Path:
    return op_dir(op) / key


def lock(op: str, key: str) -> Path:
    return op_dir(op) / f"{key}.lock"


def build_starter(op: str, key: str) -> Path:
    return op_dir(op) / f"{key}.starting.lock"


def failure(op: str, key: str) -> Path:
    return op_dir(op) / f"{key}.failed.json"


def failure_log(op: str, key: str) -> Path:
    return op_dir(op) / f"{key}.failed.log"


def discovered(op: str) -> Path:
    return op_dir(op) / "discovered.json"


def key_memo(op: str) -> Path:
    """``opbuilder.jit.fingerprint.FileMemo``'s file for ``op``, this user's own."""
    return op_dir(op) / f"keymemo-{os.getuid()}.json"


def work_root() -> Path:
    return root() / ".work"


def work_dir(op: str, digest: str) -> Path:
    return work_root() / f"{op}-{digest}"


def work_lock(work: Path) -> Path:
    return Path(f"{work}.lock")


def slots_dir() -> Path:
    return root() / ".slots"


def compilers() -> Path:
    return root() / "compilers.json"


def traces(op: str) -> Path:
    check_op_name(op)
    return root() / "traces" / op


def check_op_name(op: str) -> None:
    """Raises ValueError unless ``op`` names one folder (its traces' folder): "../x" or "/x" would be outside the cache."""
    if not isinstance(op, str) or op in ("", ".", "..") or op.startswith(".") or any(c in op for c in "/\\\0"):
        raise ValueError(f"an op's name must be one folder's name (not empty, no '/', '\\' or NUL, not starting "
                         f"with '.'), got {op!r}")


def trace(op: str, key: str, kind: str = "tune") -> Path:
    """A trace file: ``kind`` "tune" (timings) or "check" (statuses)."""
    return traces(op) / (f"{key}.json" if kind == "tune" else f"{key}.{kind}.json")


def trace_lock(op: str, key: str) -> Path:
    """The lock of a key's traces: two writers keep each other's rows."""
    return traces(op) / f"{key}.lock"
