"""``opbuilder new NAME``: a working skeleton of a user's own op, written from opbuilder/templates/op/.

The skeleton computes ``y = x * weight`` so that it builds and its test passes as generated; the user
then replaces the kernels. Template files end in ``.tmpl``; ``NAME`` in a file name and ``{{name}}`` /
``{{Name}}`` in the text are replaced. Lines between ``//@cuda`` (or ``#@cuda``) and ``//@end`` are
kept only with ``--cuda``; ``.cu``/``.cuh`` files are written only with ``--cuda``.
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates" / "op"
CUDA_FILE_SUFFIXES = (".cu", ".cuh")

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_MARKER = re.compile(r"^\s*(?://|#)@(cuda|end)\s*$")
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


def render(text: str, name: str, cuda: bool) -> str:
    """Fill the placeholders and keep or drop the CUDA sections."""
    out = []
    keep = True
    for line in text.splitlines(keepends=True):
        marker = _MARKER.match(line)
        if marker:
            keep = cuda if marker.group(1) == "cuda" else True
            continue
        if keep:
            out.append(line)
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


def plan(name: str, cuda: bool) -> list[tuple[Path, Path]]:
    """(template, path relative to the op's folder) for each file to write."""
    files = []
    for template in sorted(TEMPLATE_DIR.rglob("*.tmpl")):
        rel = template.relative_to(TEMPLATE_DIR)
        target = rel.with_name(rel.name.removesuffix(".tmpl").replace("NAME", name))
        if target.suffix in CUDA_FILE_SUFFIXES and not cuda:
            continue
        files.append((template, target))
    return files


def create(name: str, directory: Path, cuda: bool) -> list[Path]:
    """Write the skeleton of op ``name`` into ``directory/name/`` and return the files written.

    Raises ValueError for a bad name, FileExistsError when ``directory/name`` exists.
    """
    check_name(name)
    root = Path(directory) / name
    if root.exists():
        raise FileExistsError(f"opbuilder new: {root} already exists; pick another NAME or --dir")
    written = []
    for template, rel in plan(name, cuda):
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(template.read_text(), name, cuda))
        written.append(target)
    return written
