"""The few facts opbuilder reads from a shared library's ELF header: what it needs and where it looks.

Enough to find, from torch's own library, the file the dynamic loader gives it for a dependency
(``DT_NEEDED``, ``DT_RPATH``/``DT_RUNPATH`` with ``$ORIGIN``), without asking the running process.
"""

from __future__ import annotations

import os
import struct
import sysconfig
from pathlib import Path

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NEEDED, _DT_STRTAB, _DT_RPATH, _DT_RUNPATH = 1, 5, 15, 29


def dynamic_entries(path: Path) -> dict[str, list[str]]:
    """{"needed": [...], "rpath": [...], "runpath": [...]} of an ELF shared library (empty lists when the
    file is not ELF or has no dynamic section). Raises OSError when it cannot be read."""
    with open(path, "rb") as fh:
        ident = fh.read(64)
        if len(ident) < 52 or ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) or ident[5] not in (1, 2):
            return {"needed": [], "rpath": [], "runpath": []}
        wide = ident[4] == 2
        end = "<" if ident[5] == 1 else ">"
        if wide:
            phoff, = struct.unpack_from(end + "Q", ident, 0x20)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 0x36)
        else:
            phoff, = struct.unpack_from(end + "I", ident, 0x1C)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 0x2A)
        fh.seek(phoff)
        table = fh.read(phentsize * phnum)
        loads, dynamic = [], None
        for i in range(phnum):
            if wide:
                p_type, _flags, offset, vaddr, _paddr, filesz = struct.unpack_from(end + "IIQQQQ", table, i * phentsize)
            else:
                p_type, offset, vaddr, _paddr, filesz = struct.unpack_from(end + "IIIII", table, i * phentsize)
            if p_type == _PT_LOAD:
                loads.append((vaddr, offset, filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (offset, filesz)
        if dynamic is None:
            return {"needed": [], "rpath": [], "runpath": []}
        fh.seek(dynamic[0])
        raw = fh.read(dynamic[1])
        entry = struct.Struct(end + ("qQ" if wide else "iI"))
        tags: list[tuple[int, int]] = []
        for (tag, value) in entry.iter_unpack(raw[: len(raw) - len(raw) % entry.size]):
            if tag == 0:
                break
            tags.append((tag, value))
        strtab = next((v for t, v in tags if t == _DT_STRTAB), None)
        base = next((off + strtab - va for va, off, size in loads if strtab is not None and va <= strtab < va + size), None)
        if base is None:
            return {"needed": [], "rpath": [], "runpath": []}

        def string(at: int) -> str:
            fh.seek(base + at)
            data = fh.read(4096)
            return data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")

        out: dict[str, list[str]] = {"needed": [], "rpath": [], "runpath": []}
        names = {_DT_NEEDED: "needed", _DT_RPATH: "rpath", _DT_RUNPATH: "runpath"}
        for tag, value in tags:
            if tag in names:
                text = string(value)
                out[names[tag]] += [text] if tag == _DT_NEEDED else [d for d in text.split(":") if d]
        return out


def _default_dirs() -> list[str]:
    multiarch = sysconfig.get_config_var("MULTIARCH")
    arch_dirs = [f"/lib/{multiarch}", f"/usr/lib/{multiarch}"] if multiarch else []
    return arch_dirs + ["/lib64", "/usr/lib64", "/lib", "/usr/lib"]


def resolve_needed(library: Path, needed: str, ld_library_path: list[str]) -> Path | None:
    """The file the dynamic loader loads for ``library``'s dependency ``needed``: the library's
    DT_RPATH (when it has no DT_RUNPATH), LD_LIBRARY_PATH, its DT_RUNPATH, then the system folders
    (the loader's ld.so.cache is not read: what it lists lives in those folders on common systems)."""
    if "/" in needed:
        return Path(needed) if os.path.isfile(needed) else None
    entries = dynamic_entries(library)
    origin = os.path.dirname(os.path.realpath(library))

    def expand(dirs: list[str]) -> list[str]:
        return [d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin) for d in dirs]

    dirs = (expand(entries["rpath"]) if not entries["runpath"] else []) + ld_library_path
    dirs += expand(entries["runpath"]) + _default_dirs()
    for folder in dirs:
        candidate = Path(folder) / needed
        if candidate.is_file():
            return candidate
    return None
