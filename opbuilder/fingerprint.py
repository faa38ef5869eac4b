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
    # Plain strings and os.path: this runs on every warm load.
    roots = [str(p) for p in include_paths]
    seen: dict[str, None] = {}
    stack = [os.path.realpath(p) for p in sources]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen[path] = None
        try:
            with open(path, "rb") as fh:
                text = fh.read()
        except OSError:
            continue  # a missing source is reported by the build, with the compiler's words
        for quote, name in _INCLUDE.findall(text):
            rel = name.decode("utf-8", "replace")
            for root in ([os.path.dirname(path)] if quote == b'"' else []) + roots:
                candidate = os.path.join(root, rel)
                if os.path.isfile(candidate):
                    stack.append(os.path.realpath(candidate))
                    break
    return [Path(p) for p in sorted(seen)]


def digest_files(files: list[Path], roots: list[Path]) -> dict[str, str]:
    """File name -> sha256. Names are relative to the first root holding the file, so moving a
    project or reinstalling the same package elsewhere keeps its keys."""
    out = {}
    for path in files:
        name = str(path)
        for root in roots:
            if path.is_relative_to(root):
                name = f"{root.name}/{path.relative_to(root)}"
                break
        try:
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            out[name] = "missing"
    return out


def cache_key(inputs: dict[str, object]) -> str:
    """A 20-hex-digit hash of the canonical JSON of the key's inputs."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:20]
