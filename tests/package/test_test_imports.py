"""The tests share code through ``tests/helpers`` only: a test module that imports another one runs (and, under
pytest's default import mode, may import twice) the other's module-level code, and ties the two files together."""

from __future__ import annotations

import ast

from helpers import ROOT


def _imports_of_tests(source: str, where: str) -> list[str]:
    """Where ``source`` imports a test module or a conftest: ``import test_x``, ``from test_x import y``, and
    ``from dispatch import test_x`` (tests/ is on sys.path, so its folders import as packages)."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            names = []
        found += [f"{where}:{node.lineno}: {name}" for name in names
                  if name.split(".")[-1].startswith("test_") or name.split(".")[-1] == "conftest"]
    return found


def test_no_test_module_imports_another() -> None:
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        found += _imports_of_tests(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "move what they share into tests/helpers:\n" + "\n".join(found)


def test_each_way_of_importing_a_test_module_is_found() -> None:
    for source in ("import test_dispatch", "from test_dispatch import variant", "from dispatch import test_dispatch",
                   "from tests.dispatch import test_dispatch as t", "import dispatch.test_dispatch", "from conftest import x",
                   "def f():\n    from test_dispatch_robust import _variant\n"):
        assert _imports_of_tests(source, "t.py"), source
    assert _imports_of_tests("from helpers import ROOT, dispatch_userop\nimport torch.testing", "t.py") == []
