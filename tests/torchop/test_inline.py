"""Under torch.compile, a small call of a built-in op traces the op's PyTorch definition (Inductor fuses it with
its neighbours), a call at or above ``OPB_COMPILE_INLINE_BELOW`` elements our kernel; export keeps the op."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch._dynamo
from torch import nn

import opbuilder.ops as ops
from helpers import DEVICES
from opbuilder import env


def _graph_targets(fn, *args, dynamic: bool | None = None) -> list[str]:
    """The functions Dynamo's graph of ``fn(*args)`` calls (fullgraph: a break raises)."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    return [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


def _ours(targets: list[str]) -> list[str]:
    return [t for t in targets if t.startswith("opb_")]


def _calls(device: str) -> dict:
    """Each public function, called on 64 x 32 inputs (2048 elements)."""
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(64, 32, generator=g).to(device), torch.randn(64, 32, generator=g).to(device)
    w, b = torch.randn(32, generator=g).to(device), torch.randn(32, generator=g).to(device)
    rhs = torch.randn(32, 16, generator=g).to(device)
    return {
        "relu": (ops.relu, (x,)),
        "softmax": (ops.softmax, (x,)),
        "rms_norm": (ops.rms_norm, (x, w)),
        "fused_add_rmsnorm": (ops.fused_add_rmsnorm, (x, r, w)),
        "fused_relu_layernorm": (ops.fused_relu_layernorm, (x, w, b)),
        "fused_matmul_add_relu": (ops.fused_matmul_add_relu, (x, rhs, b[:16])),
    }


@pytest.mark.parametrize("name", list(_calls("cpu")))
def test_small_calls_trace_the_definition_larger_ones_the_op(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, args = _calls("cpu")[name]
    monkeypatch.delenv("OPB_COMPILE_INLINE_BELOW")
    assert env.compile_inline_below() > args[0].numel()  # the default inlines 64 x 32
    assert _ours(_graph_targets(fn, *args)) == []
    monkeypatch.setenv("OPB_COMPILE_INLINE_BELOW", str(args[0].numel()))  # at the size: our kernel
    assert _ours(_graph_targets(fn, *args)) != []
    monkeypatch.setenv("OPB_COMPILE_INLINE_BELOW", str(args[0].numel() + 1))
    assert _ours(_graph_targets(fn, *args)) == []
    monkeypatch.setenv("OPB_COMPILE_INLINE_BELOW", "0")
    assert _ours(_graph_targets(fn, *args)) != []


@pytest.mark.parametrize("name", list(_calls("cpu")))
def test_eager_calls_take_the_op_whatever_the_size(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, args = _calls("cpu")[name]
    monkeypatch.setenv("OPB_COMPILE_INLINE_BELOW", str(1 << 40))
    with _Spy() as spy:
        fn(*args)
    assert _ours(spy.seen) != [], spy.seen


class _Spy(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops a call runs (this thread's)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(_calls("cpu")))
def test_a_non_contiguous_input_gives_the_kernels_layout(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The definitions' outputs are contiguous, as the kernels' are (a view of them works in the graph)."""
    monkeypatch.delenv("OPB_COMPILE_INLINE_BELOW")
    fn, args = _calls("cpu")[name]
    args = (args[0].t().contiguous().t(), *args[1:])  # the same values, transposed strides
    assert not args[0].is_contiguous()

    def first_flat(*a):
        out = fn(*a)
        out = out[0] if isinstance(out, tuple) else out
        return out.view(-1), out

    torch._dynamo.reset()
    got_flat, got = torch.compile(first_flat, backend="aot_eager", fullgraph=True)(*args)
    want_flat, want = first_flat(*args)
    assert got.is_contiguous() and got.stride() == want.stride()
    torch.testing.assert_close(got_flat, want_flat, rtol=1e-5, atol=1e-5)


def test_a_size_known_only_at_run_time_keeps_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """x[x > 0] of a dynamic x has a size the trace cannot compare with the threshold: the op, not an error
    (of a static x, the size is at most x's, below the threshold: the definition)."""
    monkeypatch.delenv("OPB_COMPILE_INLINE_BELOW")
    x = torch.randn(64, 8)
    positive = lambda t: ops.relu(t[t > 0])  # noqa: E731
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert _ours(_graph_targets(positive, x, dynamic=True)) != []
        assert _ours(_graph_targets(positive, x, dynamic=False)) == []
        torch._dynamo.reset()
        got = torch.compile(positive, backend="aot_eager", fullgraph=True, dynamic=True)(x)
    torch.testing.assert_close(got, x[x > 0])


def test_an_eager_call_in_another_thread_during_a_compile_takes_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compiler.is_compiling() is True in every thread while a compile runs (torch 2.14): the rule asks
    Dynamo itself, so an eager call elsewhere meanwhile keeps our kernel."""
    monkeypatch.delenv("OPB_COMPILE_INLINE_BELOW")
    elsewhere = _Spy()

    def eager_call() -> None:
        with elsewhere:
            ops.relu(torch.randn(8, 8))

    def backend(gm: torch.fx.GraphModule, example_inputs):
        thread = threading.Thread(target=eager_call)
        thread.start()
        thread.join()
        return gm.forward

    # The op's first call made before, so that this tests the rule alone (a first call in each thread at once:
    # tests/dispatch/test_dispatch_builtin.py).
    ops.relu(torch.randn(8, 8))
    torch._dynamo.reset()
    torch.compile(lambda t: ops.relu(t) + 1, backend=backend, fullgraph=True)(torch.randn(8, 8))
    assert _ours(elsewhere.seen) != [], elsewhere.seen


class _Model(nn.Module):
    """Every layer once, as benchmarks/parallel_models.py uses them."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = ops.RMSNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.softmax = ops.Softmax(-1)
        self.add_norm = ops.FusedAddRMSNorm(dim)
        self.up = ops.FusedLinearReLU(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.act = ops.ReLU()
        self.head_norm = ops.FusedReLULayerNorm(dim)

    def forward(self, x):
        a = self.softmax(self.mix(self.norm(x)))
        normed, h = self.add_norm(a, x)
        return self.head_norm(h + self.act(self.down(self.up(normed))))


def _run(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The output, x's gradient and every parameter's, of one forward and backward."""
    x = x.clone().requires_grad_()
    model.zero_grad()
    out = model(x)
    out.float().square().sum().backward()
    return [out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_with_definitions_is_as_exact_as_our_kernels(device: str, dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's code for the traced definitions, and our kernels in eager, against the model in float64
    (our kernels, eager): output and every gradient. In float32 they agree closely; in bfloat16 the compiled
    model's error is within twice the kernels' own, or bfloat16's tolerance (their roundings differ)."""
    monkeypatch.delenv("OPB_COMPILE_INLINE_BELOW")
    torch.manual_seed(0)
    model = _Model(32).to(device, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, 24, 32, device=device, dtype=dtype)
    want = _run(copy.deepcopy(model).double(), x.double())
    eager = _run(model, x)
    torch._dynamo.reset()
    compiled = _run(torch.compile(model, fullgraph=True), x)
    names = ["output", "x.grad", *(f"{n}.grad" for n, _ in model.named_parameters())]
    for name, w, e, c in zip(names, want, eager, compiled):
        assert c.dtype == e.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
        else:
            c_err, e_err = (c.double() - w).abs().max().item(), (e.double() - w).abs().max().item()
            # bfloat16's tolerance (opbuilder.dispatch.definitions.TOLERANCES: rtol 2e-2) of the tensor's scale
            assert c_err <= max(2 * e_err, 2e-2 * w.abs().max().item()), (name, c_err, e_err)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_keeps_the_op(strict: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPB_COMPILE_INLINE_BELOW")

    class M(nn.Module):
        def forward(self, x):
            return ops.relu(x) + 1

    program = torch.export.export(M(), (torch.randn(4, 8),), strict=strict)
    assert _ours([str(n.target) for n in program.graph.nodes if n.op == "call_function"]) != []


@pytest.mark.parametrize("value", ["-1", "1e6", "many", " 5"])
def test_a_bad_size_is_refused_naming_the_variable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPB_COMPILE_INLINE_BELOW", value)
    with pytest.raises(ValueError, match=rf"OPB_COMPILE_INLINE_BELOW must be a whole number of elements >= 0, got '{value}'"):
        env.compile_inline_below()
