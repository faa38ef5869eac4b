"""The built-in ops' C++ gradient path (opbuilder.torchop.cxx_autograd, kernels/autograd/): the same gradients as the
Python path and as a float64 reference, recorded by C++ Nodes, with the Python path kept where the glue
cannot be had."""

from __future__ import annotations

import contextlib
import os
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import DEVICES, run_python
from opbuilder import ops
from opbuilder.builders.autograd import AutogradGlueBuilder
from opbuilder.torchop import cxx_autograd


@pytest.fixture(scope="module", autouse=True)
def glue() -> None:
    assert cxx_autograd.load(wait=True), "the glue builds and loads here (the CPU machine has a compiler)"


def _cases(device: str, dtype: torch.dtype) -> dict[str, tuple[Callable, list, str, Callable]]:
    """name -> (our function, its inputs (needing grads), the C++ Node's name, the float64 torch reference)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype).requires_grad_()

    F = torch.nn.functional
    return {
        "relu": (ops.relu, [t(7, 33)], "opbuilder::ReluBackward", torch.relu),
        "softmax": (ops.softmax, [t(7, 33)], "opbuilder::SoftmaxBackward", lambda x: torch.softmax(x, -1)),
        "fused_relu_layernorm": (ops.fused_relu_layernorm, [t(7, 33), t(33), t(33)],
                                 "opbuilder::FusedReluLayerNormBackward",
                                 lambda x, w, b: F.layer_norm(torch.relu(x), (33,), w, b, 1e-5)),
        "fused_add_rmsnorm": (ops.fused_add_rmsnorm, [t(7, 33), t(7, 33), t(33)], "opbuilder::FusedAddRMSNormBackward",
                              lambda a, r, w: (F.rms_norm(a + r, (33,), w, 1e-6), a + r)),
        "rms_norm": (ops.rms_norm, [t(7, 33), t(33)], "opbuilder::RMSNormBackward",
                     lambda a, w: F.rms_norm(a, (33,), w, 1e-6)),
        "fused_matmul_add_relu": (ops.fused_matmul_add_relu, [t(7, 12), t(12, 5), t(5)],
                                  "opbuilder::FusedMatmulAddReluBackward", lambda a, b, c: torch.relu(a @ b + c)),
    }


CASES = list(_cases("cpu", torch.float64))
_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float64: 1e-10}


def _tuple(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _grads(fn: Callable, args: list[torch.Tensor], upstream: list[torch.Tensor] | None = None):
    out = _tuple(fn(*args))
    upstream = upstream or [torch.randn_like(o) for o in out]
    return out, upstream, torch.autograd.grad(out, args, upstream, allow_unused=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_cxx_path_matches_python_path_and_reference(name: str, dtype: torch.dtype, device: str) -> None:
    fn, args, node, reference = _cases(device, dtype)[name]
    out = _tuple(fn(*args))
    assert out[0].grad_fn is not None and out[0].grad_fn.name() == node, out[0].grad_fn
    out, upstream, got = _grads(fn, args)
    with cxx_autograd.disabled():
        py_out, _, want = _grads(fn, args, upstream)
        assert out[0].grad_fn.name() != py_out[0].grad_fn.name()
    for a, b in zip(out, py_out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(got, want):  # the same kernels below both paths
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref_args = [a.detach().double().requires_grad_() for a in args]
    _, _, ref = _grads(reference, ref_args, [u.double() for u in upstream])
    tol = _TOL[dtype] * (30 if name in ("fused_relu_layernorm", "fused_add_rmsnorm", "rms_norm") else 1)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_cxx_path_gradcheck(name: str, device: str) -> None:
    fn, args, node, _ = _cases(device, torch.float64)[name]
    assert _tuple(fn(*args))[0].grad_fn.name() == node
    assert torch.autograd.gradcheck(fn, args)


def _saved(fn: Callable, args: list[torch.Tensor]) -> list[tuple]:
    """What a call saves for its backward, in order, as a saved-tensors hook sees it."""
    seen: list[tuple] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        fn(*[a * 1 for a in args])  # non-leaf inputs, as inside a model
    return seen


@pytest.mark.parametrize("name", CASES)
def test_both_paths_save_the_same_tensors_in_the_same_order(name: str) -> None:
    """Non-reentrant activation checkpointing matches what a forward saved with what its recomputation saves,
    by position: in the first process, the step whose forward ran on the Python path while the glue was built
    recomputes on the C++ path. The two paths save alike, and such a checkpoint trains."""
    fn, args, _, _ = _cases("cpu", torch.float64)[name]
    cxx = _saved(fn, args)
    with cxx_autograd.disabled():
        python = _saved(fn, args)
    assert cxx == python

    def block(*xs: torch.Tensor) -> torch.Tensor:
        return sum((o * o).sum() for o in _tuple(fn(*[a * 1 for a in xs])))

    want = torch.autograd.grad(block(*args), args)
    with cxx_autograd.disabled():  # the forward on the Python path, its recomputation on the C++ path
        loss = torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
    for a, b in zip(torch.autograd.grad(loss, args), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["rms_norm", "fused_relu_layernorm"])
@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
def test_norms_take_an_input_made_under_inference_mode(name: str, python_path: bool) -> None:
    """A frozen encoder's features, made under torch.inference_mode, into a norm whose weight trains: the norms
    save their input, which autograd refuses for such a tensor, so they save a copy; torch's RMSNorm and ReLU +
    LayerNorm (which save tensors of their own making) take it too."""
    fn, args, _, reference = _cases("cpu", torch.float64)[name]
    with torch.inference_mode():
        x = args[0].detach().clone()
    params = [a.detach().clone().requires_grad_() for a in args[1:]]
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        got = torch.autograd.grad(fn(x, *params).square().sum(), params)
    want = torch.autograd.grad(reference(x, *params).square().sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["relu", "softmax", "fused_matmul_add_relu"])
def test_double_backward_where_the_backward_has_a_formula(name: str) -> None:
    fn, args, node, _ = _cases("cpu", torch.float64)[name]
    assert _tuple(fn(*args))[0].grad_fn.name() == node
    assert torch.autograd.gradgradcheck(fn, args)


def _backward_ops(fn: Callable[[], None]) -> list[str]:
    """The names of the ops (aten's and ours, short) that fn's autograd calls ran, as the profiler saw them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.key.split("::")[-1] for e in prof.key_averages()]


# (out_features, what the upstream gradient is): float64 rows of 72 are 576 bytes, wide enough for the one pass
# on CUDA (256 or more); 20 (160 bytes) are not; a transposed gradient is not contiguous.
_ONE_PASS_CASES = {"wide": (72, "plain"), "narrow": (20, "plain"), "strided grad": (72, "transposed")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", _ONE_PASS_CASES)
@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
def test_linear_backward_takes_relu_and_bias_in_one_pass(device: str, case: str, python_path: bool) -> None:
    """The linear layer's case (2-D, a [N] bias) on CUDA, rows of 256 bytes or more, contiguous gradients: relu's
    mask and the bias's gradient from relu_bias_backward, not threshold_backward then sum; elsewhere (the CPU,
    narrow rows, a strided gradient) and with create_graph, ATen's ops, whose formulas give double backward."""
    out_features, grad_kind = _ONE_PASS_CASES[case]
    layer = ops.FusedLinearReLU(12, out_features, device=device, dtype=torch.float64)
    x = torch.randn(9, 12, device=device, dtype=torch.float64, requires_grad=True)
    params = [x, layer.weight, layer.bias]
    g = torch.randn(9, out_features, device=device, dtype=torch.float64)
    if grad_kind == "transposed":
        g = g.t().contiguous().t()
    one_pass = device == "cuda" and case == "wide"
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        y = layer(x)
        names = _backward_ops(lambda: torch.autograd.grad(y, params, g, retain_graph=True))
        assert ("relu_bias_backward" in names) == one_pass and ("threshold_backward" in names) != one_pass, names
        got = torch.autograd.grad(y, params, g, retain_graph=True)
        grads = torch.autograd.grad(y, params, g, create_graph=True)
        names = _backward_ops(lambda: torch.autograd.grad(y, params, g, create_graph=True))
        assert "threshold_backward" in names and "relu_bias_backward" not in names, names
        second = torch.autograd.grad(sum(t.square().sum() for t in grads), params)
    ref = [p.detach().clone().requires_grad_() for p in params]
    y_ref = torch.relu(ref[0] @ ref[1].t() + ref[2])
    want = torch.autograd.grad(y_ref, ref, g, create_graph=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    want_second = torch.autograd.grad(sum(t.square().sum() for t in want), ref)
    for a, b in zip(second, want_second):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["subclass", "batched", "vmap"])
@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
def test_linear_backward_keeps_wrapped_gradients_off_the_one_pass(device: str, kind: str, python_path: bool) -> None:
    """A gradient that is a tensor subclass (here torch's TwoTensor, as a DTensor or a fake would be) or that a
    vmap wraps (``is_grads_batched``, whose vmap is the legacy one, or torch.func.vmap of autograd.grad) takes
    ATen's ops, not the one pass: the subclass's own dispatch, and vmap's batching rules instead of its
    per-sample fallback for our op. The gradients match the float64 reference either way."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(5)
    layer = ops.FusedLinearReLU(12, 72, device=device, dtype=torch.float64)
    x = torch.randn(9, 12, device=device, dtype=torch.float64, requires_grad=True)
    params = [x, layer.weight, layer.bias]
    ref = [p.detach().clone().requires_grad_() for p in params]
    y_ref = torch.relu(ref[0] @ ref[1].t() + ref[2])
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        y = layer(x)
        if kind == "subclass":
            g = torch.randn(9, 72, device=device, dtype=torch.float64)
            def run():
                return torch.autograd.grad(y, params, TwoTensor(g, 2 * g), retain_graph=True)
            want = [(a, 2 * a) for a in torch.autograd.grad(y_ref, ref, g)]
        else:
            g = torch.randn(3, 9, 72, device=device, dtype=torch.float64)
            def run():
                if kind == "vmap":
                    return torch.func.vmap(lambda gi: torch.autograd.grad(y, params, gi, retain_graph=True))(g)
                return torch.autograd.grad(y, params, g, retain_graph=True, is_grads_batched=True)
            want = [torch.stack(w) for w in zip(*(torch.autograd.grad(y_ref, ref, gi, retain_graph=True) for gi in g))]
        names = _backward_ops(run)
        assert "relu_bias_backward" not in names and "threshold_backward" in names, names
        got = run()
    for a, b in zip(got, want):
        if kind == "subclass":
            assert type(a) is TwoTensor
            torch.testing.assert_close(a.a, b[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(a.b, b[1], rtol=1e-12, atol=1e-12)
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_shape", [(72,), (1,), ()], ids=str)
@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
def test_linear_backward_with_a_broadcast_bias(device: str, bias_shape: tuple, python_path: bool) -> None:
    """A bias of one value broadcast to every column gets its gradient summed over the columns too: only a [N]
    bias takes the one pass."""
    torch.manual_seed(11)
    args = [torch.randn(shape, device=device, dtype=torch.float64, requires_grad=True)
            for shape in ((9, 12), (12, 72), bias_shape)]
    g = torch.randn(9, 72, device=device, dtype=torch.float64)
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        got = torch.autograd.grad(ops.fused_matmul_add_relu(*args), args, g)
    ref = [a.detach().clone().requires_grad_() for a in args]
    want = torch.autograd.grad(torch.relu(ref[0] @ ref[1] + ref[2]), ref, g)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["fused_relu_layernorm", "fused_add_rmsnorm", "rms_norm"])
@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
def test_double_backward_elsewhere_is_a_clear_error(name: str, python_path: bool) -> None:
    """The norms have no double backward: a gradient recorded with create_graph=True is still the gradient (a
    gradient penalty's value, torch.func's transforms), and only a second-order gradient through it raises,
    with the op's name, on either path (the Python path once gave zeros there, with only torch's warning)."""
    fn, args, _, reference = _cases("cpu", torch.float64)[name]
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        out = _tuple(fn(*args))
        grads = torch.autograd.grad(out[0].square().sum(), args, create_graph=True)
        want = torch.autograd.grad(_tuple(reference(*args))[0].square().sum(), args)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        penalty = sum(g.square().sum() for g in grads)
        with pytest.raises(RuntimeError, match=f"^{name}: double backward .*not supported"):
            torch.autograd.grad(penalty, args)
        # The same under a non-reentrant checkpoint, which lets a saved tensor be unpacked once.
        loss = torch.utils.checkpoint.checkpoint(lambda *xs: _tuple(fn(*xs))[0].square().sum(), *args,
                                                 use_reentrant=False)
        for a, b in zip(torch.autograd.grad(loss, args, create_graph=True), want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shapes", [((9, 12), (12, 5)), ((2, 9, 12), (12, 5)), ((2, 9, 12), (2, 12, 5))], ids=str)
@pytest.mark.parametrize("frozen", ["rhs", "lhs"])
@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
def test_matmul_keeps_only_what_its_gradients_read(shapes: tuple, frozen: str, python_path: bool) -> None:
    """As aten's addmm: with the weight frozen, the layer's input is not kept for the backward (it would stay alive
    as long as the graph does), and with the input needing no gradient, the weight is not; the gradients that are
    asked for match float64, for a transposed weight too."""
    torch.manual_seed(8)
    lhs = torch.randn(*shapes[0], dtype=torch.float64)
    rhs = torch.randn(*shapes[1], dtype=torch.float64)
    if rhs.dim() == 2:
        rhs = rhs.t().contiguous().t()  # the layer's weight.t(): a transposed view
    bias = torch.randn(shapes[1][-1], dtype=torch.float64, requires_grad=True)
    trained = rhs if frozen == "lhs" else lhs
    trained.requires_grad_()
    saved: list[int] = []
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
            y = ops.fused_matmul_add_relu(lhs, rhs, bias)
        got = torch.autograd.grad(y.square().sum(), [trained, bias])
    # The trained one's gradient reads the frozen one; nothing reads the trained one.
    assert trained.data_ptr() not in saved and (rhs if frozen == "rhs" else lhs).data_ptr() in saved, saved
    ref = [t.detach().clone().requires_grad_(t is trained) for t in (lhs, rhs)]
    b = bias.detach().clone().requires_grad_()
    want = torch.autograd.grad(torch.relu(ref[0] @ ref[1] + b).square().sum(), [ref[0] if frozen == "rhs" else ref[1], b])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)


FORWARD_AD = r"""
import sys, torch
import torch.autograd.forward_ad as fwAD
sys.path.insert(0, "tests")
from torchop.test_cxx_autograd import _cases
from torchop.test_eager import _cases as eager_cases

registered = {name: cases[1] for name, cases in eager_cases().items()}
for name, (fn, args, node, reference) in _cases("cpu", torch.float64).items():
    plain = [a.detach() for a in args]
    with fwAD.dual_level():
        dual = fwAD.make_dual(plain[0], torch.ones_like(plain[0]))
        try:
            fn(dual, *plain[1:])
        except NotImplementedError as e:
            assert f"forward AD with opbuilder's {name}" in str(e), e
            print(name, "refused")
        else:
            print(name, "passed through")
        # The registered op (what torch.ops, a trace and DTensor reach): with Python formulas, torch.library's
        # Autograd kernel sent a dual input below autograd and returned no tangent.
        try:
            registered[name](dual, *plain[1:])
        except NotImplementedError as e:
            assert "forward AD with opbuilder's" in str(e), e
            print(name, "refused")
        else:
            print(name, "passed through")
"""


@pytest.mark.parametrize("cxx", ["1", "0"], ids=["cxx", "python"])
def test_forward_ad_is_refused_on_either_path(cxx: str, cxx_autograd_glue: Path) -> None:
    """The ops have no forward-mode formula: a dual input is refused with the op's name on both paths (the Python
    path's formulas, torch.library's, let it through and dropped the tangent: a wrong answer). A fresh process,
    so that with OPB_CXX_AUTOGRAD=0 the registered ops carry the Python formulas."""
    result = run_python(FORWARD_AD, env={"OPB_CXX_AUTOGRAD": cxx})
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == [w for name in CASES for w in (name, "refused") * 2], result.stdout


@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
def test_second_order_through_residual_out_alone(python_path: bool) -> None:
    """fused_add_rmsnorm's residual_out is input + residual: where only it reaches the loss, the backward hands
    its gradient on, and a second-order gradient through it is the sum's, on either path."""
    a, r, w = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((4, 6), (4, 6), (6,)))
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        h = ops.fused_add_rmsnorm(a, r, w)[1]
        (g,) = torch.autograd.grad(h.pow(3).sum(), a, create_graph=True)
        (got,) = torch.autograd.grad(g.sum(), a)
    torch.testing.assert_close(got, 6 * (a + r).detach(), rtol=1e-12, atol=1e-12)


FUNC_GRAD = r"""
import sys, torch
sys.path.insert(0, "tests")
from opbuilder.torchop import cxx_autograd
assert cxx_autograd.load(wait=True)
from torchop.test_cxx_autograd import _cases, _tuple

def loss(f, *xs):
    return sum((o * o).sum() for o in _tuple(f(*xs)))

for name, (fn, args, node, reference) in _cases(sys.argv[1], torch.float64).items():
    plain = [a.detach() for a in args]
    nums = tuple(range(len(plain)))
    got = torch.func.grad(lambda *xs: loss(fn, *xs), argnums=nums)(*plain)
    want = torch.func.grad(lambda *xs: loss(reference, *xs), argnums=nums)(*plain)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    # grad of grad: where the backward has a formula, the second derivative; the norms refuse it clearly (their
    # kernels run below every level: an outer level would otherwise see a constant and give zeros)
    def nested(f):
        return torch.func.grad(lambda x: torch.func.grad(lambda t: loss(f, t, *plain[1:]))(x).sum())(plain[0])
    try:
        second = nested(fn)
    except RuntimeError as e:
        assert name in ("rms_norm", "fused_add_rmsnorm", "fused_relu_layernorm"), (name, e)
        assert str(e).startswith(name + ": double backward"), e
    else:
        torch.testing.assert_close(second, nested(reference), rtol=1e-9, atol=1e-9)
    print(name, "ok")
"""


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_grad_takes_the_cxx_path(device: str, cxx_autograd_glue: Path) -> None:
    """torch.func.grad records the backward (its transforms always do) and calls the registered ops, whose
    Autograd kernels are the C++ Nodes where the glue was loaded before a process first used them (a fresh
    process here: in this one another test may have given an op its Python formula first, which torch.func's
    transforms refuse): a first-order gradient through every op, the norms included, matches float64; a
    grad of grad matches it where the backward has a formula and is a clear error for the norms."""
    result = run_python(FUNC_GRAD.replace("sys.argv[1]", repr(device)))
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == [w for name in CASES for w in (name, "ok")], result.stdout


@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
def test_only_the_used_inputs_get_gradients(python_path: bool) -> None:
    """fused_add_rmsnorm with only residual_out (x + r) in the loss: the weight gets no gradient (None, as
    with torch's add and rms_norm, so that an optimizer skips it rather than stepping a zero gradient: Adam's
    momentum and weight decay would move it), x and r the loss's gradient of x + r."""
    a = torch.randn(5, 8, requires_grad=True)
    r = torch.randn(5, 8)  # needs no gradient
    w = torch.randn(8, requires_grad=True)
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        out, h = ops.fused_add_rmsnorm(a, r, w)
        assert (out.grad_fn.name() == "opbuilder::FusedAddRMSNormBackward") != python_path
        (ga, gw) = torch.autograd.grad((3 * h).sum(), [a, w], allow_unused=True)
        torch.testing.assert_close(ga, torch.full_like(a, 3.0))
        assert gw is None
        ops.fused_add_rmsnorm(a, r, w)[1].sum().backward()
        assert w.grad is None and torch.equal(a.grad, torch.ones_like(a))
        out, h = ops.fused_add_rmsnorm(a, r, w)  # out alone: the kernel's gradients, the weight's too
        gw = torch.autograd.grad(out.sum(), [w])[0]
        torch.testing.assert_close(gw, torch.autograd.grad(torch.nn.functional.rms_norm(a + r, (8,), w, 1e-6).sum(), w)[0])


def test_a_norm_without_weight_and_bias_gets_no_edges_for_them() -> None:
    """No weight, no bias: the Node has no edge for them, and the leaf x gets its .grad as with torch's ops."""
    torch.manual_seed(21)
    x = torch.randn(3, 8, requires_grad=True)
    y = ops.fused_relu_layernorm(x, None, None)
    assert y.grad_fn.name() == "opbuilder::FusedReluLayerNormBackward"
    y.pow(2).sum().backward()
    x64 = x.detach().double().requires_grad_()
    want = torch.autograd.grad(torch.nn.functional.layer_norm(torch.relu(x64), (8,)).pow(2).sum(), x64)[0]
    # float32 against the float64 reference, per row: a row of few positive values has a small variance, and its
    # gradient's terms cancel (over 3000 seeds ours reached 117 eps of the row's largest gradient + 1, torch's
    # own float32 ops 184; an unseeded 1e-5 absolute bound failed once in CI's run of this test).
    bound = 256 * torch.finfo(torch.float32).eps * (want.abs().amax(dim=-1, keepdim=True) + 1)
    err = (x.grad.double() - want).abs()
    assert bool((err <= bound).all()), f"error {err.max().item():.3g} above the bound {bound.min().item():.3g}"


def test_in_place_change_of_a_saved_tensor_is_caught() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    y = ops.softmax(x)  # saves y
    assert y.grad_fn.name() == "opbuilder::SoftmaxBackward"
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_compile_fullgraph_with_a_backward_takes_the_registered_op() -> None:
    x = torch.randn(6, 10, requires_grad=True)
    w = torch.randn(10, requires_grad=True)
    fn = torch.compile(lambda t, w: ops.rms_norm(ops.relu(t), w).sum(), backend="aot_eager", fullgraph=True)
    fn(x, w).backward()
    want_x, want_w = torch.autograd.grad(torch.nn.functional.rms_norm(torch.relu(x), (10,), w, 1e-6).sum(), [x, w])
    torch.testing.assert_close(x.grad, want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, want_w, rtol=1e-5, atol=1e-5)


def test_autocast_with_an_autocast_rule_takes_the_registered_op() -> None:
    # An op's autocast rule sits on its registered overload, not on .grad: under autocast, a call that records a
    # gradient must take the registered op, or the rule would not cast. softmax's rule is CUDA's; a CPU rule
    # made in a fresh process (the op is shared by this process's tests) shows it here: a bfloat16 x comes out
    # float32 only through the registered op.
    code = textwrap.dedent("""
        import sys, torch
        from opbuilder import ops
        from opbuilder.torchop import cxx_autograd
        import opbuilder.ops.softmax
        forward = sys.modules["opbuilder.ops.softmax"].forward_op()
        torch.library.register_autocast(forward, "cpu", torch.float32)
        x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
        print("plain", ops.softmax(x).dtype, ops.softmax(x).grad_fn.name(), cxx_autograd.state())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ops.softmax(x)
        y.sum().backward()
        print("autocast", y.dtype, y.grad_fn.name(), x.grad.dtype)
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "plain torch.bfloat16 opbuilder::SoftmaxBackward ready", result.stdout
    assert lines[1] == "autocast torch.float32 opbuilder::SoftmaxBackward torch.bfloat16", result.stdout


def test_glue_is_keyed_by_the_exact_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    builder = AutogradGlueBuilder()
    assert builder.abi() == "classic" and builder.key_inputs()["torch"] == torch.__version__
    key = builder.key
    monkeypatch.setattr(torch, "__version__", "99.0.0")
    builder.refresh()
    assert builder.key != key


_TRAIN = """
import warnings
warnings.simplefilter("always")
import torch
from opbuilder import ops
from opbuilder.torchop import cxx_autograd
layer = ops.FusedLinearReLU(8, 8)
x = torch.randn(4, 8, requires_grad=True)
for _ in range(3):
    layer(x).sum().backward()
    torch.relu(torch.zeros(1))
print("state", cxx_autograd.state(), "grad_fn", type(ops.fused_matmul_add_relu(x, layer.weight.t(), layer.bias).grad_fn).__name__, "trained", layer.weight.grad is not None)
"""


def _cache_without_glue(src: Path, dst: Path) -> None:
    for entry in src.iterdir():
        if entry.is_dir() and entry.name not in ("autograd",) and not entry.name.startswith(".work"):
            shutil.copytree(entry, dst / entry.name, symlinks=True)


def test_without_a_compiler_training_takes_the_python_path_with_one_warning(tmp_path: Path) -> None:
    ops.fused_matmul_add_relu(torch.randn(2, 3), torch.randn(3, 2))  # built in the run's cache
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    _cache_without_glue(Path(os.environ["OPB_CACHE_DIR"]), cache)
    # The op loads (built with the real compiler) without recording a gradient (the layer's parameters need
    # one: a call outside no_grad would start the glue's build with the real compiler); the compiler is gone
    # before the first gradient.
    code = _TRAIN.replace("for _ in", "with torch.no_grad():\n    layer(x)\nimport os\n"
                                      "os.environ['CXX'] = '/nonexistent/c++'\nfor _ in")
    result = run_python(code + "import time\nwhile cxx_autograd.state() in ('building', 'waiting'):\n    time.sleep(0.2)\n"
                        "    layer(x).sum().backward()\nprint('final', cxx_autograd.state())\n",
                        env={"OPB_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grad_fn Eager_" in result.stdout and "trained True" in result.stdout, result.stdout
    assert "final off" in result.stdout, result.stdout
    lines = [line for line in result.stderr.splitlines() if "take the Python path" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "C++ compiler '/nonexistent/c++' not found" in lines[0], lines[0]


def test_opting_out_takes_the_python_path_silently(tmp_path: Path) -> None:
    result = run_python(_TRAIN, env={"OPB_CXX_AUTOGRAD": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "state off grad_fn Eager_" in result.stdout and "trained True" in result.stdout, result.stdout
    assert "Python path" not in result.stderr


def test_a_torch_upgrade_never_loads_the_old_glue(tmp_path: Path) -> None:
    # The run's cache holds this torch's glue (the module fixture); a process claiming another torch must
    # not load it: it starts its own build (stopped here: the test is about what it loads).
    code = ("import torch\ntorch.__version__ = '99.0.0'\nfrom opbuilder.torchop import cxx_autograd\n"
            "print('loaded', cxx_autograd.load(wait=False), cxx_autograd.state())\n"
            "cxx_autograd._build.kill()\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded False building" in result.stdout, result.stdout


@pytest.mark.parametrize("bias_shape", [(5,), (7, 5), (1,), None])
@pytest.mark.parametrize("transposed", [True, False])
def test_matmul_backward_of_the_linear_layer_case(bias_shape: tuple | None, transposed: bool) -> None:
    """The 2-D case's own backward (two mm and a column sum): a weight used transposed (the layer's
    weight.t()) gets a gradient of the weight's layout; every bias shape sums right."""
    g = torch.Generator().manual_seed(3)
    lhs = torch.randn(7, 12, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(5, 12, generator=g, dtype=torch.float64).requires_grad_()
    plain = torch.randn(12, 5, generator=g, dtype=torch.float64).requires_grad_()
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=g, dtype=torch.float64).requires_grad_()

    def fn(lhs, rhs_source, *bias):
        rhs = rhs_source.t() if transposed else rhs_source
        return ops.fused_matmul_add_relu(lhs, rhs, *bias)

    args = [lhs, weight if transposed else plain] + ([bias] if bias is not None else [])
    assert fn(*args).grad_fn.name() == "opbuilder::FusedMatmulAddReluBackward"
    out, upstream, got = _grads(fn, args)
    with cxx_autograd.disabled():
        _, _, want = _grads(fn, args, upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert a.stride() == b.stride()
    assert torch.autograd.gradcheck(fn, args)


def test_calls_without_a_gradient_never_ask_for_the_glue() -> None:
    code = ("import torch\nfrom opbuilder import ops\nfrom opbuilder.torchop import cxx_autograd\n"
            "x = torch.randn(4, 8)\nops.relu(x); ops.softmax(x); ops.rms_norm(x, torch.ones(8))\n"
            "with torch.no_grad():\n    ops.relu(x.requires_grad_())\n"
            "print('state', cxx_autograd.state())\n"
            "ops.relu(x)\nprint('after a gradient', cxx_autograd.state())\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "state new" in result.stdout and "after a gradient ready" in result.stdout, result.stdout


_REGISTERED = """
import sys, torch
from torch.autograd import forward_ad as fwAD
import opbuilder.ops.fused_add_rmsnorm, opbuilder.ops.fused_matmul_add_relu, opbuilder.ops.fused_relu_layernorm
import opbuilder.ops.relu, opbuilder.ops.softmax
from opbuilder.torchop import cxx_autograd
m = {n: sys.modules["opbuilder.ops." + n] for n in ("relu", "softmax", "fused_relu_layernorm", "fused_add_rmsnorm",
                                                  "fused_matmul_add_relu")}
registered = [m["relu"].relu_op(), m["relu"].relu_mask_op(), m["relu"].relu_mask_backward_op(), m["softmax"].forward_op(),
              m["softmax"].backward_op(), m["fused_relu_layernorm"].fused_relu_layernorm_op(),
              m["fused_add_rmsnorm"].fused_add_rmsnorm_op(), m["fused_add_rmsnorm"].rms_norm_op(),
              m["fused_matmul_add_relu"].fused_matmul_add_relu_op()]
sites = []
for op in registered:
    line = [l for l in torch._C._dispatch_dump(op._schema.name).splitlines() if l.startswith("Autograd[alias]")][0]
    python = any(f in line for f in ("torch/library.py", "torch/_library/", "opbuilder/torchop/eager.py"))
    sites.append("glue" if "kernels/autograd/glue.cpp" in line else "python" if python else line)
print("sites", " ".join(sorted(set(sites))), "state", cxx_autograd.state())
"""


def test_registered_ops_get_the_glues_autograd_kernels() -> None:
    # The glue is in the run's cache (the module fixture): a fresh process's registered ops (what torch.ops,
    # a trace, torch.compile's graphs and DTensor reach) get C++ Autograd kernels, whose gradients are the
    # Python formulas' (the eager Python path, from the same formulas) and the float64 reference's.
    code = _REGISTERED + textwrap.dedent("""
        import torch.nn.functional as F
        g = torch.Generator().manual_seed(0)
        t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
        relu, relu_mask, mask_bwd, sm, sm_bwd, ln, add_rms, rms, mm = registered
        cases = {
            "relu": (relu, [t(7, 33)], torch.relu),
            "relu_mask": (lambda x: relu_mask(x)[0], [t(7, 33)], torch.relu),
            "softmax": (sm, [t(7, 33)], lambda x: torch.softmax(x, -1)),
            "fused_relu_layernorm": (lambda x, w, b: ln(x, w, b, 1e-5)[0], [t(7, 33), t(33), t(33)],
                                     lambda x, w, b: F.layer_norm(torch.relu(x), (33,), w, b, 1e-5)),
            "fused_add_rmsnorm": (lambda a, r, w: add_rms(a, r, w, 1e-6), [t(7, 33), t(7, 33), t(33)],
                                  lambda a, r, w: (F.rms_norm(a + r, (33,), w, 1e-6), a + r)),
            "rms_norm": (lambda a, w: rms(a, w, 1e-6), [t(7, 33), t(33)], lambda a, w: F.rms_norm(a, (33,), w, 1e-6)),
            "fused_matmul_add_relu": (mm, [t(7, 12), t(12, 5), t(5)], lambda a, b, c: torch.relu(a @ b + c)),
        }
        tup = lambda o: o if isinstance(o, tuple) else (o,)
        for name, (fn, args, ref) in cases.items():
            out = tup(fn(*args))
            assert all("opbuilder::" in o.grad_fn.name() for o in out), (name, [o.grad_fn for o in out])
            up = [torch.randn_like(o) for o in out]
            got = torch.autograd.grad(out, args, up)
            want = torch.autograd.grad(tup(ref(*args)), args, up)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
            assert torch.autograd.gradcheck(fn, args), name
        # double backward: relu's (relu_mask_backward is linear) and softmax's (its backward op's formula)
        x = t(5, 9)
        assert torch.autograd.gradgradcheck(lambda x: relu_mask(x)[0], (x,))
        assert torch.autograd.gradgradcheck(sm, (x,))
        assert torch.autograd.gradgradcheck(lambda y, g: sm_bwd(y, g), (sm(x).detach().requires_grad_(), t(5, 9)))
        # a compiled graph with a backward through them
        f = torch.compile(lambda x, w: rms(relu(x), w, 1e-6).sum() + sm(x).pow(2).sum(), backend="aot_eager",
                          fullgraph=True)
        x, w = t(6, 10), t(10)
        f(x, w).backward()
        want = torch.autograd.grad(F.rms_norm(torch.relu(x), (10,), w, 1e-6).sum() + torch.softmax(x, -1).pow(2).sum(),
                                   [x, w])
        torch.testing.assert_close((x.grad, w.grad), want, rtol=1e-10, atol=1e-10)
        # forward AD: refused by name, never a tangent silently lost
        with fwAD.dual_level():
            dual = fwAD.make_dual(torch.randn(3, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64))
            for fn in (relu, sm, lambda d: rms(d, torch.ones(4, dtype=torch.float64), 1e-6)):
                try:
                    fn(dual)
                    print("forward AD: no error")
                except NotImplementedError as exc:
                    assert "forward AD" in str(exc) and "does not support it" in str(exc), exc
        print("checked")
    """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sites glue state ready" in result.stdout and "checked" in result.stdout, result.stdout
    assert "forward AD: no error" not in result.stdout, result.stdout


def test_without_the_glue_in_the_cache_the_registered_ops_take_their_formulas_and_nothing_builds(tmp_path: Path) -> None:
    ops.relu(torch.randn(3))  # the op builds are in the run's cache
    for name in ("softmax", "fused_relu_layernorm", "rms_norm", "fused_matmul_add_relu"):
        getattr(ops, name)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    _cache_without_glue(Path(os.environ["OPB_CACHE_DIR"]), cache)
    code = _REGISTERED + textwrap.dedent("""
        x = torch.randn(4, 6, requires_grad=True)
        registered[0](x).sum().backward()
        assert torch.equal(x.grad, (x > 0).float())
        print("after", cxx_autograd.state())
    """)
    result = run_python(code, env={"OPB_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    # the registered ops' first use needs their formulas at once: Python's, and no build of the glue started
    assert "sites python state new" in result.stdout and "after new" in result.stdout, result.stdout
