"""Importing the ops is free; the first call builds; that first call may be inside torch.compile."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from helpers import run_python

from opbuilder import paths


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


def test_warm_first_call_imports_no_tool_and_no_build_machinery(tmp_path: Path) -> None:
    """The warm first call of a built-in op (its build in the cache) loads it and registers it: it imports
    no benchmark or other tool, no compiler driver, nothing numpy or torchgen that torch had not, no other
    op's module and nothing of dispatch's records; and it reads none of the op's sources (the key's memo
    of them holds: ``opbuilder.jit.fingerprint.FileMemo``)."""
    warm = textwrap.dedent("""
        import sys, torch
        from opbuilder.paths import INCLUDE_DIR, KERNELS_DIR
        x = torch.randn(16)
        before = set(sys.modules)
        roots = (str(KERNELS_DIR) + "/", str(INCLUDE_DIR) + "/")
        read = []
        sys.addaudithook(lambda event, args: read.append(str(args[0])) if event == "open"
                         and str(args[0]).startswith(roots) else None)
        import opbuilder.ops as ops
        ops.relu(x)
        new = sorted(set(sys.modules) - before)
        bad = [m for m in new if m.startswith(("opbuilder.tools", "opbuilder.bench", "opbuilder.jit.compile", "numpy", "torchgen",
                                               "unittest", "torch.utils.cpp_extension", "opbuilder.dispatch.record",
                                               "opbuilder.dispatch.definitions", "opbuilder.dispatch.implementations"))]
        print("BAD", bad)
        print("OPS", [m for m in new if m.startswith("opbuilder.ops.")])
        print("READ", read)
    """)
    first = run_python("import torch\nimport opbuilder.ops as ops\nops.relu(torch.randn(4))")
    assert first.returncode == 0, first.stderr
    # relu's builds alone, in a cache no check or tune left a trace in (a trace makes the first call
    # weigh the implementations it names: dispatch's records and definitions are then imported).
    shutil.copytree(paths.op_dir("relu"), tmp_path / "cache" / "relu", symlinks=True)
    env = {"OPB_CACHE_DIR": str(tmp_path / "cache")}
    assert run_python(warm, env=env).returncode == 0  # a warm load keeps the key's memo for the next one
    result = run_python(warm, env=env)
    assert result.returncode == 0, result.stderr
    assert "BAD []" in result.stdout, result.stdout
    assert "OPS ['opbuilder.ops._checks', 'opbuilder.ops.relu']" in result.stdout, result.stdout
    assert "READ []" in result.stdout, result.stdout


def test_each_op_module_is_imported_at_the_first_use_of_its_names() -> None:
    code = textwrap.dedent("""
        import importlib, sys, torch
        import opbuilder.ops as ops
        print("AT IMPORT", [m for m in sys.modules if m.startswith("opbuilder.ops.")])
        importlib.import_module("opbuilder.ops.softmax")  # the module by its name, as registry.record does
        assert ops.softmax.__name__ == "softmax" and ops.Softmax.__name__ == "Softmax", "the function, not the module"
        from opbuilder.ops import FusedLinearReLU, rms_norm
        assert rms_norm.__module__ == "opbuilder.ops.fused_add_rmsnorm" and FusedLinearReLU.__name__ == "FusedLinearReLU"
        assert set(ops.__all__) <= set(dir(ops))
        assert all(getattr(ops, name).__name__ == name for name in ops.__all__)
        try:
            ops.no_such_op
        except AttributeError as exc:
            print("ERROR", exc)
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "AT IMPORT []" in result.stdout
    assert "ERROR module 'opbuilder.ops' has no attribute 'no_such_op'" in result.stdout


def test_a_call_without_gradient_registers_no_autograd_formula_with_torch() -> None:
    """An op's Python autograd formulas reach torch (``torch.library.register_autograd``, half a millisecond
    each) when a call records a gradient or goes through the dispatcher, not at a first call without one;
    its fakes are there from the load (a meta tensor takes the eager path too), each naming its own line."""
    code = textwrap.dedent("""
        import torch
        import opbuilder.ops as ops
        from opbuilder.ops.relu import relu_mask_op
        from opbuilder.torchop import lazy

        ops.relu(torch.randn(5))
        ns = lazy._NAMESPACES["relu"]  # the loaded namespace
        def autograd():
            return [torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{op}", "Autograd")
                    for op in ("relu", "relu_mask", "relu_mask_backward")]
        print("NOGRAD", autograd())
        print("META", ops.relu(torch.empty(2, 3, device="meta")).shape)
        print("SOURCE", torch._library.simple_registry.singleton.find(f"{ns}::relu_mask").fake_impl.kernel.source)
        x = torch.randn(5, requires_grad=True)
        ops.relu(x).sum().backward()
        print("GRAD", autograd(), x.grad.tolist() == (x > 0).float().tolist())

        # the registered op, first reached after a call without gradient: its formula is registered
        ops.softmax(torch.randn(2, 3))
        s = lazy._NAMESPACES["softmax"]
        first = torch._C._dispatch_has_kernel_for_dispatch_key(f"{s}::forward", "Autograd")
        from opbuilder.ops.softmax import forward_op
        z = torch.randn(2, 3, requires_grad=True)
        forward_op()(z)[:, 0].sum().backward()
        print("SOFTMAX", first, torch._C._dispatch_has_kernel_for_dispatch_key(f"{s}::forward", "Autograd"),
              torch.allclose(z.grad, torch.autograd.grad(torch.softmax(z, -1)[:, 0].sum(), z)[0]))
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    out = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert out["NOGRAD"] == "[False, False, False]"
    assert out["META"] == "torch.Size([2, 3])"
    assert out["SOURCE"].endswith(tuple(f"ops/relu.py:{n}" for n in range(30, 60))), out["SOURCE"]
    assert out["GRAD"] == "[True, True, True] True"
    assert out["SOFTMAX"] == "False True True"
