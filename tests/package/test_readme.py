"""The README stays true: its variable table matches opbuilder.env, its commands exist."""

from __future__ import annotations

import re

from helpers import ROOT
from opbuilder import env


def test_every_variable_is_in_the_readme_table() -> None:
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `([A-Z_<>]+)` \|", readme, flags=re.MULTILINE))
    assert table == set(env.VARIABLES), f"README table vs env.VARIABLES differ: {table ^ set(env.VARIABLES)}"


def test_the_two_commands_are_the_ones_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    demo, test = (line.split("#", 1)[0].strip() for line in block.strip().splitlines())
    assert demo == "./run demo" and test.startswith("./run test"), block
    assert test in (ROOT / ".ci" / "run").read_text().splitlines(), f"CI does not run the README's {test!r}"


def test_the_layout_names_every_package_and_module() -> None:
    """The README's Layout section names each wing of opbuilder/ and every module in it."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "opbuilder"
    for folder in sorted(p for p in package.rglob("__init__.py") if "templates" not in p.parts):
        wing = folder.parent
        if wing == package:
            continue
        assert f"{wing.name}/" in layout, f"the Layout section does not name {wing.relative_to(ROOT)}/"
        for module in sorted(wing.glob("*.py")):
            if module.stem not in ("__init__", "__main__") and wing.name not in ("builders", "bench"):
                assert re.search(rf"\b{module.stem}\b", layout), f"the Layout section does not name {module.relative_to(ROOT)}"
    for module in sorted(package.glob("*.py")):
        if module.stem not in ("__init__", "__main__", "_checkout"):
            assert f"{module.name}" in layout, f"the Layout section does not name {module.relative_to(ROOT)}"


def test_every_file_the_docs_name_exists() -> None:
    """A path of this repository that the README or a benchmark's or tool's docstring names (``tests/...py``,
    ``benchmarks/...py``, ``kernels/...``) is there: the layout moved files once, and the README kept naming
    ``tests/test_deepspeed.py``. A header is looked for where ``#include <opbuilder/...>`` finds it.
    benchmarks/NOTES.md is a log: its paths are those of their day."""
    pattern = re.compile(r"(?<![\w/.])((?:tests|benchmarks|kernels|opbuilder|ops)/[\w/]+\.(?:py|cpp|cu|cuh|h|sh|md))\b")
    docs = [ROOT / "README.md", *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "opbuilder").rglob("*.py"))]
    missing = sorted({f"{doc.relative_to(ROOT)}: {path}" for doc in docs for path in pattern.findall(doc.read_text())
                      if not (ROOT / path).exists() and not (ROOT / "opbuilder" / "include" / path).exists()})
    assert not missing, "named but not there:\n" + "\n".join(missing)
