"""The cache key: a hash of everything that can change the built binary.

Sources and every project header they include (followed transitively), all flags, the builder's
version, torch / CUDA / C++ ABI, the Python ABI, the compilers' identity and version, the CUDA archs
and the CPU ISA. Headers outside the project (torch, CUDA, the C++ library) are covered by the torch
version and the compiler identity instead of being read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^">]+)[">]', re.MULTILINE)


def project_files(sources: list[Path], include_paths: list[Path]) -> list[Path]:
    """The sources and every header they reach through ``#include`` that lies in the project.

    A quoted include is looked up beside the including file, then in the include paths; an angle
    include only in the include paths (so ``<torch/...>`` and ``<vector>`` are not followed).
    """
    # Plain strings and os.path: this runs on every warm load. A file is visited once (by its real
    # path), but its own quoted includes are looked up beside the path it was reached by, as the
    # compiler does for a header reached through a symbolic link.
    roots = [str(p) for p in include_paths]
    seen: dict[str, str] = {}
    stack = [os.path.abspath(p) for p in sources]
    while stack:
        path = stack.pop()
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen[real] = path
        try:
            with open(path, "rb") as fh:
                text = fh.read()
        except OSError:
            continue  # a missing source is reported by the build, with the compiler's words
        for quote, name in _INCLUDE.findall(text):
            rel = name.decode("utf-8", "replace")
            for root in ([os.path.dirname(path)] if quote == b'"' else []) + roots:
                candidate = os.path.normpath(os.path.join(root, rel))
                if os.path.isfile(candidate):
                    stack.append(candidate)
                    break
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


def digest_files(files: list[Path], roots: list[Path]) -> dict[str, str]:
    """File name (``digest_name``) -> sha256, or "missing"."""
    out = {}
    for path in files:
        try:
            out[digest_name(path, roots)] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            out[digest_name(path, roots)] = "missing"
    return out


DISCOVERED = "discovered.json"


def discovered_files(op: str) -> list[str]:
    """Headers that an earlier build of ``op`` read although no include path predicted them
    (``#include MACRO``, CPATH, a header beside a symbolic link's target): their contents join the key.

    Kept in ``<cache root>/<op>/discovered.json`` by ``opbuilder.compile``; one small read, or none.
    """
    from opbuilder import env

    try:
        with open(env.cache_root() / op / DISCOVERED, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return []
    files = data.get("files") if isinstance(data, dict) else None
    return sorted(f for f in files if isinstance(f, str)) if isinstance(files, list) else []


def cache_key(inputs: dict[str, object]) -> str:
    """A 20-hex-digit hash of the canonical JSON of the key's inputs."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:20]
