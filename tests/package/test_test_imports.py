"""The tests share code through ``tests/helpers`` only: a test module that imports another one runs (and, under
pytest's default import mode, may import twice) the other's module-level code, and ties the two files together."""

from __future__ import annotations

import ast

from helpers import ROOT


def test_no_test_module_imports_another() -> None:
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[-1].startswith("test_") or name.split(".")[-1] == "conftest"]
    assert found == [], "move what they share into tests/helpers:\n" + "\n".join(found)
