"""``opbuilder new NAME``: a working skeleton of a user's own op, written from opbuilder/templates/op/.

The skeleton computes ``y = x * weight`` so that it builds and its test passes as generated; the user
then replaces the kernels. Its binding is on the LibTorch stable ABI (``<opbuilder/stable.h>``) unless
``--abi classic`` asks for ``torch/library.h`` and ATen.

Template files end in ``.tmpl``; ``NAME`` in a file name and ``{{name}}`` / ``{{Name}}`` in the text are
replaced. A file named ``X.stable.tmpl`` or ``X.classic.tmpl`` is written, as ``X``, only for that ABI.
Lines between ``//@cuda`` (or ``#@cuda``) and ``//@end`` are kept only with ``--cuda``, those between
``//@stable`` or ``//@classic`` and ``//@end`` only for that ABI; sections nest. ``.cu``/``.cuh`` files
are written only with ``--cuda``.
"""

from __future__ import annotations

import keyword
import re
import shutil
from pathlib import Path

from opbuilder.paths import TEMPLATE_DIR

CUDA_FILE_SUFFIXES = (".cu", ".cuh")
#: The binding styles ``opbuilder new --abi`` writes; the first is the default.
ABIS = ("stable", "classic")

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_MARKER = re.compile(r"^\s*(?://|#)@(cuda|stable|classic|end)\s*$")
# Names that would shadow what the generated code imports or collide in C++.
_RESERVED = {"torch", "opbuilder", "ops", "test", "tests", "std", "at", "c10", "opb"}


def check_name(name: str) -> None:
    """Raise ValueError unless ``name`` can be a Python package, a C++ identifier and an op name."""
    if not _NAME.match(name):
        raise ValueError(
            f"opbuilder new: NAME must be lower_snake_case (a letter, then letters, digits or '_'), got {name!r}"
        )
    if keyword.iskeyword(name) or name in _RESERVED:
        raise ValueError(f"opbuilder new: NAME {name!r} is reserved; pick another, e.g. 'my_{name}'")


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_") if part)


def check_abi(abi: str) -> None:
    if abi not in ABIS:
        raise ValueError(f"opbuilder new: --abi must be one of {', '.join(ABIS)}, got {abi!r}")


def render(text: str, name: str, cuda: bool, abi: str = ABIS[0]) -> str:
    """Fill the placeholders and keep or drop the CUDA and ABI sections."""
    check_abi(abi)
    wanted = {"cuda": cuda, "stable": abi == "stable", "classic": abi == "classic"}
    out = []
    open_sections: list[str] = []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        marker = _MARKER.match(line)
        if marker:
            if marker.group(1) != "end":
                open_sections.append(marker.group(1))
            elif open_sections:
                open_sections.pop()
            else:
                raise ValueError(f"template line {number}: @end without an open section")
            continue
        if all(wanted[section] for section in open_sections):
            out.append(line)
    if open_sections:
        raise ValueError(f"template: section @{open_sections[-1]} is never closed by @end")
    values = {
        "{{name}}": name,
        "{{Name}}": camel(name),
        "{{cuda_or}}": " or CUDA" if cuda else "",
        "{{cuda_and}}": " and CUDA" if cuda else "",
    }
    result = "".join(out)
    for placeholder, value in values.items():
        result = result.replace(placeholder, value)
    return result


def plan(name: str, cuda: bool, abi: str = ABIS[0]) -> list[tuple[Path, Path]]:
    """(template, path relative to the op's folder) for each file to write."""
    check_abi(abi)
    files = []
    for template in sorted(TEMPLATE_DIR.rglob("*.tmpl")):
        rel = template.relative_to(TEMPLATE_DIR)
        stem = rel.name.removesuffix(".tmpl")
        variant = stem.rsplit(".", 1)[-1]
        if variant in ABIS:
            if variant != abi:
                continue
            stem = stem.removesuffix(f".{variant}")
        target = rel.with_name(stem.replace("NAME", name))
        if target.suffix in CUDA_FILE_SUFFIXES and not cuda:
            continue
        files.append((template, target))
    return files


def create(name: str, directory: Path, cuda: bool, abi: str = ABIS[0]) -> list[Path]:
    """Write the skeleton of op ``name`` into ``directory/name/`` and return the files written.
    ``abi``: ``"stable"`` (the LibTorch stable ABI) or ``"classic"`` (``torch/library.h`` and ATen).

    Raises ValueError for a bad name or ABI, FileExistsError when ``directory/name`` exists, OSError naming
    the folder when it cannot be written (then nothing of the skeleton is left behind).
    """
    check_name(name)
    check_abi(abi)
    root = Path(directory) / name
    try:
        root.mkdir(parents=True)  # ours from here: removed whole if a file cannot be written
    except FileExistsError:
        raise FileExistsError(f"opbuilder new: {root} already exists; pick another NAME or --dir") from None
    except OSError as exc:
        raise OSError(f"opbuilder new: cannot make {root} (--dir {directory}): {exc.strerror or exc}") from None
    written = []
    try:
        for template, rel in plan(name, cuda, abi):
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(render(template.read_text(), name, cuda, abi))
            written.append(target)
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise OSError(f"opbuilder new: cannot write {root}: {exc.strerror or exc}; nothing was left there") from None
    return written
