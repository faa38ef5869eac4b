"""The cache key: a hash of everything that can change the built binary.

Sources and every project header they include (followed transitively), all flags, the builder's
version, torch / CUDA / C++ ABI, the Python ABI, the compilers' identity and version, the CUDA archs
and the CPU ISA. Headers outside the project (torch, CUDA, the C++ library) are covered by the torch
version and the compiler identity instead of being read.

What the key reads of a file -- its sha256, its ``#include`` lines, which ABI markers it holds -- is
remembered in the cache (``FileMemo``, ``<op>/keymemo-<uid>.json``) together with the file's status (size,
mtime, ctime, inode, device), as git's index remembers its hashes: a warm load stats the files instead of
reading and hashing them. Any change to a file's status, an entry too young to be sure of, or a memo file
that is damaged, not this user's or writable by others means the file is read and hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import NamedTuple

from opbuilder.errors import CacheError

_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^">]+)[">]', re.MULTILINE)

#: What marks a source as written on the stable ABI, and what ties it to one torch build
#: (``OpBuilder.abi``; ``PYBIND11_MODULE`` also makes it a Python module, ``OpBuilder.is_python_module``).
STABLE_MARKERS = (b"opbuilder/stable.h", b"torch/csrc/stable/")
CLASSIC_MARKERS = (b"torch/extension.h", b"torch/library.h", b"<ATen/", b"<c10/core", b"PYBIND11_MODULE",
                   b"opbuilder/binding.h")
_MARKERS = STABLE_MARKERS + CLASSIC_MARKERS


class Facts(NamedTuple):
    """What the key reads of one file's contents."""

    sha256: str
    includes: tuple[tuple[str, str], ...]  # (quote: '"' or '<', name) of each #include line, in order
    markers: frozenset[bytes]  # the members of STABLE_MARKERS + CLASSIC_MARKERS found in it


def facts_of(data: bytes) -> Facts:
    includes = tuple((quote.decode(), name.decode("utf-8", "replace")) for quote, name in _INCLUDE.findall(data))
    return Facts(hashlib.sha256(data).hexdigest(), includes, frozenset(m for m in _MARKERS if m in data))


def _signature(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


class FileMemo:
    """Each file's ``Facts``, read once per process and remembered across processes while the file's
    status is unchanged (``path``: the memo file in the cache; None: nothing kept beyond this object).

    An entry is reused only when the file's (size, mtime, ctime, inode, device) are those it was read
    with, and its mtime and ctime are older than the memo file by ``MARGIN_NS`` (git's "racily clean"
    rule: an edit in the same clock tick as the read could leave the status as it was; a rewrite that
    restores the size and mtime, ``touch -d``, still moves the ctime). The memo file is untrusted input:
    it is used only when it is a regular file owned by this user and writable by no one else, and any
    entry that does not have the expected form is dropped; a dropped entry means the file is read again.
    """

    VERSION = 1
    MARGIN_NS = 2_000_000_000
    MAX_BYTES = 4 << 20

    def __init__(self, path: Path | None = None, trust: bool = True) -> None:
        self.path = path
        self._kept = self._read() if path is not None and trust else {}
        self._seen: dict[str, tuple[tuple[int, ...], Facts]] = {}
        # What this object found of the file system, asked once (one key is worked out from one view of it).
        self._real: dict[str, str] = {}
        self._included: dict[tuple[str, tuple[str, ...]], list[str] | None] = {}
        self.reads = 0  # files read (and hashed) by this object: the warm path reads none

    def realpath(self, path: str) -> str:
        real = self._real.get(path)
        if real is None:
            real = self._real[path] = os.path.realpath(path)
        return real

    def included(self, path: str, roots: tuple[str, ...]) -> list[str] | None:
        """The files ``path``'s ``#include`` lines name, as found (``project_files``); None when it cannot be read."""
        key = (path, roots)
        if key not in self._included:
            facts = self.facts(path)
            found = None if facts is None else []
            for quote, rel in facts.includes if facts is not None else ():
                for root in ((os.path.dirname(path),) if quote == '"' else ()) + roots:
                    candidate = os.path.normpath(os.path.join(root, rel))
                    if os.path.isfile(candidate):
                        found.append(candidate)
                        break
            self._included[key] = found
        return self._included[key]

    def facts(self, path: str) -> Facts | None:
        """The file's facts, or None when it cannot be read (missing, a folder, no permission)."""
        try:
            sig = _signature(os.stat(path))
        except OSError:
            return None
        seen = self._seen.get(path) or self._kept.get(path)
        if seen is not None and seen[0] == sig:
            self._seen[path] = seen
            return seen[1]
        try:
            with open(path, "rb") as fh:
                before = _signature(os.fstat(fh.fileno()))
                data = fh.read()
                after = _signature(os.fstat(fh.fileno()))
        except OSError:
            return None
        self.reads += 1
        facts = facts_of(data)
        if before == after:  # else it changed while read: not remembered
            self._seen[path] = (after, facts)
        return facts

    def save(self) -> None:
        """Keep the entries used by this object for the next process (an atomic replace of the memo file,
        mode 0600), when they differ from the file's; never raises (the memo only saves time)."""
        if self.path is None or self._seen == self._kept:
            return
        files = {p: [*sig, f.sha256, [list(i) for i in f.includes], sorted(_MARKERS.index(m) for m in f.markers)]
                 for p, (sig, f) in self._seen.items()}
        text = json.dumps({"version": self.VERSION, "markers": [m.decode() for m in _MARKERS],
                           "written_ns": time.time_ns(), "files": files}, separators=(",", ":"))
        from opbuilder.jit import cache

        try:
            cache.write_text_atomic(self.path, text, private=True)
        except (OSError, CacheError):
            pass

    def _read(self) -> dict[str, tuple[tuple[int, ...], Facts]]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return {}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022 \
                    or st.st_size > self.MAX_BYTES:
                return {}
            with os.fdopen(fd, "rb", closefd=False) as fh:
                data = json.loads(fh.read())
        except (OSError, ValueError):
            return {}
        finally:
            os.close(fd)
        if not isinstance(data, dict) or data.get("version") != self.VERSION \
                or data.get("markers") != [m.decode() for m in _MARKERS] or not isinstance(data.get("files"), dict):
            return {}
        written = data.get("written_ns")
        if type(written) is not int:
            return {}
        young = min(written, st.st_mtime_ns) - self.MARGIN_NS  # entries changed after this are not sure
        kept = {}
        for path, entry in data["files"].items():
            facts = _entry(entry)
            if facts is not None and max(entry[1], entry[2]) < young:
                kept[path] = (tuple(entry[:5]), facts)
        return kept


def _entry(entry: object) -> Facts | None:
    """A memo entry's facts, or None when it is not [size, mtime, ctime, inode, device, sha256, includes, markers]."""
    if not (isinstance(entry, list) and len(entry) == 8 and all(type(v) is int and v >= 0 for v in entry[:5])):
        return None
    sha, includes, markers = entry[5:]
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        return None
    if not (isinstance(includes, list) and all(
            isinstance(i, list) and len(i) == 2 and i[0] in ('"', "<") and isinstance(i[1], str) for i in includes)):
        return None
    if not (isinstance(markers, list) and all(type(m) is int and 0 <= m < len(_MARKERS) for m in markers)):
        return None
    return Facts(sha, tuple((q, n) for q, n in includes), frozenset(_MARKERS[m] for m in markers))


def project_files(sources: list[Path], include_paths: list[Path], memo: FileMemo | None = None) -> list[Path]:
    """The sources and every header they reach through ``#include`` that lies in the project.

    A quoted include is looked up beside the including file, then in the include paths; an angle
    include only in the include paths (so ``<torch/...>`` and ``<vector>`` are not followed).
    ``memo``: where the files' contents are read (and remembered).
    """
    memo = memo if memo is not None else FileMemo()
    # Plain strings and os.path: this runs on every warm load. A file is visited once (by its real
    # path), but its own quoted includes are looked up beside the path it was reached by, as the
    # compiler does for a header reached through a symbolic link.
    roots = tuple(str(p) for p in include_paths)
    seen: dict[str, str] = {}
    stack = [os.path.abspath(p) for p in sources]
    while stack:
        path = stack.pop()
        real = memo.realpath(path)
        if real in seen:
            continue
        seen[real] = path
        found = memo.included(path, roots)
        if found is None:
            continue  # a missing source is reported by the build, with the compiler's words
        stack += found
    return [Path(p) for p in sorted(seen.values())]


#: How ``digest_name`` labels the roots builders pass: the op's source root, opbuilder's headers, then the
#: project holding the op's files (``OpBuilder.digest_roots``).
ROOT_LABELS = ("op", "opbuilder", "project")


def digest_name(path: Path, roots: list[Path]) -> str:
    """``path`` relative to the first root holding it (prefixed by that root's label), else absolute:
    so moving or renaming a project, or reinstalling the package elsewhere, keeps its keys."""
    for label, root in zip(ROOT_LABELS, roots):
        if path.is_relative_to(root):
            return f"{label}/{path.relative_to(root)}"
    return str(path)


def digest_files(files: list[Path], roots: list[Path], memo: FileMemo | None = None) -> dict[str, str]:
    """File name (``digest_name``) -> sha256, or "missing". ``memo``: as in ``project_files``."""
    memo = memo if memo is not None else FileMemo()
    out = {}
    for path in files:
        facts = memo.facts(str(path))
        out[digest_name(path, roots)] = facts.sha256 if facts is not None else "missing"
    return out


def discovered_files(op: str) -> list[str]:
    """Headers that an earlier build of ``op`` read although no include path predicted them
    (``#include MACRO``, CPATH, a header beside a symbolic link's target): their contents join the key.

    Kept in ``<cache root>/<op>/discovered.json`` by ``opbuilder.jit.compile``; one small read, or none.
    """
    from opbuilder import paths
    from opbuilder.jit import cache

    try:
        data = json.loads(cache.read_record(paths.discovered(op)))
    except (OSError, ValueError):
        return []
    files = data.get("files") if isinstance(data, dict) else None
    return sorted(f for f in files if isinstance(f, str)) if isinstance(files, list) else []


def cache_key(inputs: dict[str, object]) -> str:
    """A 20-hex-digit hash of the canonical JSON of the key's inputs."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:20]
