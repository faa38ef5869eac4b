"""``torch.jit.trace`` of models with our layers: the graph holds each op's registered op, checked by the trace's own
sanity check (a second trace under ``no_grad``), and the process keeps its C++ gradient path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from helpers import DEVICES, run_python

_TRACE_EVERY_LAYER = textwrap.dedent("""
    import sys, warnings
    import torch
    import opbuilder.ops as ops
    from opbuilder.errors import FallbackWarning
    from opbuilder.torchop import cxx_autograd

    warnings.simplefilter("error", FallbackWarning)  # a registration that fails under the tracer: fail here
    torch.manual_seed(0)
    layers = {"ReLU": ops.ReLU(), "Softmax": ops.Softmax(-1), "RMSNorm": ops.RMSNorm(8),
              "FusedReLULayerNorm": ops.FusedReLULayerNorm(8), "FusedLinearReLU": ops.FusedLinearReLU(8, 6)}
    for name, layer in layers.items():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), layer).to(DEVICE, torch.float64)  # parameters: a gradient
        x = torch.randn(5, 8, dtype=torch.float64, device=DEVICE)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                traced = torch.jit.trace(model, x)  # check_trace: traced again under no_grad, graphs compared
            y = traced(x)
            y.square().sum().backward()
            got = [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            want = model(x)
            want.square().sum().backward()
            torch.testing.assert_close(y, want)
            for g, p in zip(got, model.parameters()):
                torch.testing.assert_close(g, p.grad)
            model.zero_grad(set_to_none=True)
    norm = ops.FusedAddRMSNorm(8).to(DEVICE, torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64, device=DEVICE)
    r = torch.randn(5, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    out, res = torch.jit.trace(norm, (x, r))(x, r)
    want_out, want_res = norm(x, r)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(res, want_res)

    # The tracing left the C++ path on, the registered ops' Autograd kernels included.
    assert cxx_autograd.state() == "ready", cxx_autograd.state()
    softmax = sys.modules["opbuilder.ops.softmax"]
    node = softmax.forward_op()(torch.randn(3, 4, device=DEVICE, requires_grad=True)).grad_fn.name()
    assert node.startswith("opbuilder::"), node
    print("OK")
""")


@pytest.mark.parametrize("device", DEVICES)
def test_trace_of_every_layer_with_and_without_grad(device: str, cxx_autograd_glue: Path) -> None:
    # A fresh process: the registered ops' Autograd kernels are bound at their first use, here under the tracer.
    result = run_python("import warnings; warnings.filterwarnings('ignore', category=FutureWarning)\n"
                        f"DEVICE = {device!r}\n" + _TRACE_EVERY_LAYER)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


_TRACE_WHILE_ANOTHER_THREAD_COMPILES = textwrap.dedent("""
    import threading, warnings
    import torch
    import opbuilder.ops as ops

    warnings.filterwarnings("ignore", category=FutureWarning)
    started, release = threading.Event(), threading.Event()

    def backend(gm, example_inputs):  # holds the other thread's compile open while this one traces
        started.set()
        release.wait(120)
        return gm

    other = threading.Thread(target=lambda: torch.compile(lambda v: v * 2 + 1, backend=backend)(torch.randn(3)))
    other.start()
    assert started.wait(120)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), ops.ReLU())
    x = torch.randn(5, 8)
    try:
        traced = torch.jit.trace(model, x)  # relu: one op with or without a gradient, whatever the other thread does
    finally:
        release.set()
        other.join()
    torch.testing.assert_close(traced(x), model(x))
    print("OK")
""")


def test_trace_while_another_thread_compiles(cxx_autograd_glue: Path) -> None:
    # torch.compiler.is_compiling() is True in every thread while any compile runs (torch 2.14): the trace must ask
    # Dynamo's own flag, or relu takes relu_mask with a gradient and relu in the trace's check under no_grad.
    result = run_python(_TRACE_WHILE_ANOTHER_THREAD_COMPILES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
