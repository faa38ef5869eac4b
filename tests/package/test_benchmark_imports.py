"""The benchmark scripts name opbuilder's modules in their own imports and in the code they hand to child
processes (string snippets run with ``python -c``); a module moved or a name renamed broke them silently (the
remote-cluster benchmark's ranks called ``router.bypass`` for months after the layout moved it to ``routes``).
Each such import, and each attribute read from a module imported so, must exist."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from helpers import ROOT

SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "benchmarks" / "tuning").glob("*.py"))


def _codes(path: Path) -> list[tuple[str, ast.Module]]:
    """The script and each of its string constants that parses as Python with an opbuilder import."""
    tree = ast.parse(path.read_text())
    found = [(path.name, tree)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "opbuilder" in node.value \
                and "import" in node.value and "\n" in node.value:
            try:
                found.append((f"{path.name}:{node.lineno}", ast.parse(node.value)))
            except SyntaxError:
                continue  # a template filled in by .format, or prose
    return found


def _problems(where: str, tree: ast.Module) -> list[str]:
    problems: list[str] = []
    modules: dict[str, object] = {}  # local name -> an opbuilder module imported under it
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "opbuilder" \
                and node.level == 0:
            parent = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(parent, alias.name, None)
                if value is None:
                    try:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        problems.append(f"{where}: from {node.module} import {alias.name}: no such name")
                        continue
                if type(value).__name__ == "module":
                    modules[alias.asname or alias.name] = value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "opbuilder":
                    module = importlib.import_module(alias.name)
                    if alias.asname:
                        modules[alias.asname] = module
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and isinstance(node.ctx, ast.Load) and not hasattr(modules[node.value.id], node.attr):
            problems.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}: "
                            f"{modules[node.value.id].__name__} has no {node.attr!r}")
    return problems


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_benchmark_names_only_what_opbuilder_has(path: Path) -> None:
    problems = [p for where, tree in _codes(path) for p in _problems(where, tree)]
    assert not problems, "\n".join(problems)
