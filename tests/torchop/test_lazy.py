"""Importing the ops is free; the first call builds; that first call may be inside torch.compile."""

from __future__ import annotations

import textwrap
from pathlib import Path

from helpers import run_python


def test_import_builds_nothing_and_pulls_in_no_compiler(fresh_cache: Path) -> None:
    code = textwrap.dedent("""
        import sys, torch
        import opbuilder.ops
        heavy = [m for m in ("torch._dynamo", "torch.utils.cpp_extension", "filelock") if m in sys.modules]
        print("HEAVY", heavy)
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout
    assert result.stderr == ""
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir())


def test_first_call_inside_torch_compile_fullgraph(cxx_autograd_glue: Path) -> None:
    code = textwrap.dedent("""
        import torch
        from opbuilder.ops import relu
        f = torch.compile(lambda x: relu(x * 2) + 1, fullgraph=True)
        x = torch.randn(8, requires_grad=True)
        y = f(x)
        y.sum().backward()
        assert torch.equal(y, torch.relu(x * 2) + 1)
        assert torch.equal(x.grad, 2.0 * (x > 0))
        print("OK")
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_warm_first_call_imports_no_tool_and_no_build_machinery() -> None:
    """The warm first call of a built-in op (its build in the cache) loads it and registers it: it imports
    no benchmark or other tool, no compiler driver, and nothing numpy or torchgen that torch had not."""
    warm = textwrap.dedent("""
        import sys, torch
        x = torch.randn(16)
        before = set(sys.modules)
        import opbuilder.ops as ops
        ops.relu(x)
        new = sorted(set(sys.modules) - before)
        bad = [m for m in new if m.startswith(("opbuilder.tools", "opbuilder.bench", "opbuilder.jit.compile", "numpy", "torchgen",
                                               "unittest", "torch.utils.cpp_extension"))]
        print("BAD", bad)
    """)
    first = run_python("import torch\nimport opbuilder.ops as ops\nops.relu(torch.randn(4))")
    assert first.returncode == 0, first.stderr
    result = run_python(warm)
    assert result.returncode == 0, result.stderr
    assert "BAD []" in result.stdout, result.stdout
