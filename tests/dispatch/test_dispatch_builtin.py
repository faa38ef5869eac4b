"""Dispatch of the built-in ops (opbuilder.ops): the direct path, a trace's choices, torch.compile,
autograd, and the fallback when no compiler is there."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import opbuilder.ops as ops
from helpers import run_python
from opbuilder.dispatch import check, router as dispatch, implementations

SPY_CALLS: list[tuple[int, ...]] = []


def relu_trace(fastest: dict[str, str]) -> Path:
    """Store a trace for relu in which every implementation passed and ``fastest[workload]`` (default
    "compiled") is the fastest: the trace is this test's input, so it is written, not measured."""
    from opbuilder.dispatch import definitions, trace

    rows = []
    for w in definitions.get("relu").workloads_for(torch.device("cpu")):
        x = torch.empty(w.shape, device="meta")
        for impl in ("compiled", "torch.compile", "reference"):
            rows.append(check.Row(impl, w.name, list(w.shape), "float32", "cpu", trace.device_name("cpu"),
                                  list(trace.bucket(x)), "PASSED", 0.0, 0.0, "",
                                  1.0 if fastest.get(w.name, "compiled") == impl else 9.0))
    path = check.save("relu", rows, "tune")
    dispatch.reset("relu")
    return path


@pytest.fixture
def relu_spy():
    """relu's reference replaced by a spy; a trace in which the reference is the fastest for the small
    workloads (one row, odd widths, empty) and our op for 4096x4096. Everything is put back afterwards."""
    original = implementations.of("relu")
    reference = next(i for i in original if i.name == "reference")

    def spy(x: torch.Tensor) -> torch.Tensor:
        SPY_CALLS.append(tuple(x.shape))
        return reference.fn(x)

    implementations.register("relu", implementations.python("reference", spy, kind="reference"))
    path = relu_trace({"one row": "reference", "odd widths": "reference", "empty": "reference"})
    SPY_CALLS.clear()
    yield
    path.unlink()
    implementations.register("relu", reference)
    dispatch.reset("relu")


def test_no_trace_leaves_the_direct_path() -> None:
    dispatch.reset("softmax")
    assert "softmax" in dispatch.ROUTES
    x = torch.randn(3, 5)
    torch.testing.assert_close(ops.softmax(x), torch.softmax(x, -1))
    assert "softmax" not in dispatch.ROUTES  # later calls: one dict lookup, then today's path
    assert dispatch.router("softmax").pick(x) == "compiled"


def test_trace_sends_small_shapes_to_the_reference(relu_spy) -> None:
    # relu's workloads: 4096x4096, and the edge shapes 1x1024, 7x111, 0x1024; 8x64 is in no bucket of them
    small, odd, big, other = torch.randn(1, 1024), torch.randn(7, 111), torch.randn(4096, 4096), torch.randn(8, 64)
    for x in (small, odd, big, other):
        torch.testing.assert_close(ops.relu(x), torch.relu(x), rtol=0, atol=0)
    assert SPY_CALLS == [(1, 1024), (7, 111)]
    assert dispatch.router("relu").pick(other) == "compiled"  # no times there: the default
    assert "relu" in dispatch.ROUTES and dispatch.router("relu").pick(big) == "compiled"


def test_routed_op_under_autograd_and_torch_compile(relu_spy) -> None:
    x = torch.randn(7, 111, requires_grad=True)
    ops.relu(x).sum().backward()
    torch.testing.assert_close(x.grad, (x > 0).float())
    assert SPY_CALLS == [(7, 111)]

    compiled = torch.compile(lambda t: ops.relu(t) * 2, fullgraph=True)  # a graph break would raise
    y = torch.randn(7, 111)
    torch.testing.assert_close(compiled(y), torch.relu(y) * 2)


def test_routed_op_under_jit_trace(relu_spy) -> None:
    # Under torch.jit.trace a tensor's sizes are traced tensors: the router reads them with the tracer paused.
    x = torch.randn(7, 111)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated
        traced = torch.jit.trace(ops.relu, x)
    assert SPY_CALLS[0] == (7, 111)  # the trace's bucket for 7x111: the reference
    torch.testing.assert_close(traced(x), torch.relu(x))


def test_a_trace_choosing_torch_compile_inside_a_compiled_caller() -> None:
    """The trace picks torch.compile of the reference for 7x111; a compiled caller traces the reference
    itself (no compiled function inside a compiled one)."""
    path = relu_trace({"odd widths": "torch.compile"})
    try:
        x = torch.randn(7, 111)
        assert dispatch.router("relu").pick(x) == "torch.compile"
        compiled = torch.compile(lambda t: ops.relu(t) + 1, fullgraph=True)
        torch.testing.assert_close(compiled(x), torch.relu(x) + 1)
    finally:
        path.unlink()
        dispatch.reset("relu")


def test_first_call_inside_torch_compile_fullgraph() -> None:
    dispatch.reset("fused_add_rmsnorm")
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    compiled = torch.compile(lambda a, b, c: ops.fused_add_rmsnorm(a, b, c)[0], fullgraph=True)
    h = (x + r).double()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(compiled(x, r, w).double(), want, rtol=1e-5, atol=1e-5)
    assert "fused_add_rmsnorm" in dispatch.ROUTES  # resolved while Dynamo traced: left at the next eager call
    ops.fused_add_rmsnorm(x, r, w)
    assert "fused_add_rmsnorm" not in dispatch.ROUTES
    torch.testing.assert_close(compiled(x, r, w).double(), want, rtol=1e-5, atol=1e-5)


NO_COMPILER = """
import json, warnings, torch
warnings.simplefilter("always")
import opbuilder.ops as ops
from opbuilder.errors import FallbackWarning
x, r, w, b = torch.randn(7, 111), torch.randn(7, 111), torch.randn(111), torch.randn(111)
lhs, rhs, bias = torch.randn(7, 13), torch.randn(13, 5), torch.randn(5)
calls = {
    "relu": (lambda: ops.relu(x), lambda: torch.relu(x)),
    "softmax": (lambda: ops.softmax(x, 0), lambda: torch.softmax(x, 0)),
    "fused_add_rmsnorm": (lambda: ops.fused_add_rmsnorm(x, r, w)[0],
                          lambda: (x + r) * torch.rsqrt((x + r).pow(2).mean(-1, keepdim=True) + 1e-6) * w),
    "fused_relu_layernorm": (lambda: ops.fused_relu_layernorm(x, w, b),
                             lambda: torch.nn.functional.layer_norm(x.relu(), (111,), w, b, 1e-5)),
    "fused_matmul_add_relu": (lambda: ops.fused_matmul_add_relu(lhs, rhs, bias), lambda: (lhs @ rhs + bias).relu()),
}
out = {}
for name, (ours, want) in calls.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [ours() for _ in range(3)]
    torch.testing.assert_close(got[0], want(), rtol=1e-5, atol=1e-5)
    out[name] = [str(c.message) for c in caught if issubclass(c.category, FallbackWarning)]
# autograd through the fallback (the reference)
xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
ops.fused_relu_layernorm(xg, w, b).pow(2).sum().backward()
torch.nn.functional.layer_norm(xr.relu(), (111,), w, b, 1e-5).pow(2).sum().backward()
torch.testing.assert_close(xg.grad, xr.grad)
print("RESULT", json.dumps(out))
"""


def test_no_compiler_runs_every_builtin_op_through_the_fallback(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {"PATH": str(empty), "OPB_CACHE_DIR": str(tmp_path / "cache"), "CXX": ""}
    result = run_python(NO_COMPILER, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT"))
    warned = json.loads(line.removeprefix("RESULT "))
    assert set(warned) == {"relu", "softmax", "fused_add_rmsnorm", "fused_relu_layernorm", "fused_matmul_add_relu"}
    for op, messages in warned.items():
        assert len(messages) == 1, (op, messages)
        assert f"opbuilder: {op}: " in messages[0] and "not found on PATH" in messages[0]
        assert messages[0].endswith("calls go to reference")


def test_report_shows_implementations_and_picks(relu_spy) -> None:
    from opbuilder.tools import dispatch_report

    d = dispatch_report.op_dispatch("relu")
    assert [i["name"] for i in d["implementations"]] == ["compiled", "torch.compile", "reference"]
    assert {i["name"]: i["last_check"] for i in d["implementations"]} == {
        "compiled": "PASSED", "torch.compile": "PASSED", "reference": "PASSED"}
    assert "reference" in d["picks"].values() and "compiled" in d["picks"].values()
    text = dispatch_report.render({"relu": d})
    assert "relu" in text and "reference" in text


def test_first_eager_call_elsewhere_while_a_trace_resolves_the_op() -> None:
    """A trace resolves the op (its first call) while another thread makes its first eager call: the routes
    Dynamo guards on stay as traced until the tracing thread's own next call (before: KeyError 'relu' from
    Dynamo's guards, InternalTorchDynamoError), and the other thread's call runs the op all the same."""
    import threading

    dispatch.reset("relu")
    results = []

    def eager_call() -> None:
        x = torch.randn(8, 8)
        results.append(torch.equal(ops.relu(x), torch.relu(x)))

    def backend(gm, example_inputs):
        thread = threading.Thread(target=eager_call)
        thread.start()
        thread.join()
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(8, 8)
    compiled = torch.compile(lambda t: ops.relu(t) + 1, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.relu(x) + 1)
    assert results == [True]
    assert "relu" in dispatch.ROUTES  # left at this thread's next eager call
    ops.relu(x)
    assert "relu" not in dispatch.ROUTES
    torch.testing.assert_close(compiled(x), torch.relu(x) + 1)
