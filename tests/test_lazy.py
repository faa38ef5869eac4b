"""Importing the ops is free; the first call builds; that first call may be inside torch.compile."""

from __future__ import annotations

import textwrap
from pathlib import Path

from conftest import run_python


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


def test_first_call_inside_torch_compile_fullgraph() -> None:
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
