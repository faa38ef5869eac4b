"""The eager fast path (opbuilder/torchop/eager.py): plain calls skip the Python autograd kernel, calls that
need a gradient get the registered formula through a Function of their own, and every other context
(Dynamo, functorch, forward AD, autocast) takes the registered op."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import TorchDispatchMode

import opbuilder.ops.fused_add_rmsnorm  # noqa: F401 (the op modules _cases reads; alone, this file imports them)
import opbuilder.ops.fused_matmul_add_relu  # noqa: F401
import opbuilder.ops.fused_relu_layernorm  # noqa: F401
import opbuilder.ops.relu  # noqa: F401
import opbuilder.ops.softmax  # noqa: F401
from opbuilder import ops
from opbuilder.torchop import eager

# name -> (our call, the same through the registered torch.ops op, inputs builder)
_W = lambda n: torch.randn(n, dtype=torch.float64)  # noqa: E731


def _cases() -> dict[str, tuple[Callable, Callable, Callable[[], list[torch.Tensor]]]]:
    relu_mod = sys.modules["opbuilder.ops.relu"]
    softmax_mod = sys.modules["opbuilder.ops.softmax"]
    ln_mod = sys.modules["opbuilder.ops.fused_relu_layernorm"]
    rms_mod = sys.modules["opbuilder.ops.fused_add_rmsnorm"]
    mm_mod = sys.modules["opbuilder.ops.fused_matmul_add_relu"]
    return {
        "relu": (ops.relu, lambda x: relu_mod.relu_mask_op()(x)[0], lambda: [torch.randn(5, 7, dtype=torch.float64)]),
        "softmax": (ops.softmax, lambda x: softmax_mod.forward_op()(x), lambda: [torch.randn(5, 7, dtype=torch.float64)]),
        "fused_relu_layernorm": (
            ops.fused_relu_layernorm,
            lambda x, w, b: ln_mod.fused_relu_layernorm_op()(x, w, b, 1e-5)[0],
            lambda: [torch.randn(5, 7, dtype=torch.float64), _W(7), _W(7)],
        ),
        "fused_add_rmsnorm": (
            lambda a, r, w: ops.fused_add_rmsnorm(a, r, w, 1e-6),
            lambda a, r, w: rms_mod.fused_add_rmsnorm_op()(a, r, w, 1e-6),
            lambda: [torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64), _W(7)],
        ),
        "rms_norm": (
            lambda a, w: ops.rms_norm(a, w, 1e-6),
            lambda a, w: rms_mod.rms_norm_op()(a, w, 1e-6),
            lambda: [torch.randn(5, 7, dtype=torch.float64), _W(7)],
        ),
        "fused_matmul_add_relu": (
            ops.fused_matmul_add_relu,
            lambda a, b, c: mm_mod.fused_matmul_add_relu_op()(a, b, c),
            lambda: [torch.randn(5, 6, dtype=torch.float64), torch.randn(6, 7, dtype=torch.float64), _W(7)],
        ),
    }


CASES = list(_cases())
# name -> the registered op (qualified name) that _cases' second callable calls
_REGISTERED_NAME = {
    "relu": lambda: sys.modules["opbuilder.ops.relu"].relu_mask_op()._schema.name,
    "softmax": lambda: sys.modules["opbuilder.ops.softmax"].forward_op()._schema.name,
    "fused_relu_layernorm": lambda: sys.modules["opbuilder.ops.fused_relu_layernorm"].fused_relu_layernorm_op()._schema.name,
    "fused_add_rmsnorm": lambda: sys.modules["opbuilder.ops.fused_add_rmsnorm"].fused_add_rmsnorm_op()._schema.name,
    "rms_norm": lambda: sys.modules["opbuilder.ops.fused_add_rmsnorm"].rms_norm_op()._schema.name,
    "fused_matmul_add_relu": lambda: sys.modules["opbuilder.ops.fused_matmul_add_relu"].fused_matmul_add_relu_op()._schema.name,
}
_DIRECT = eager.direct


@contextmanager
def python_calls() -> Iterator[list[str]]:
    """The files of every Python function called inside the block."""
    files: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001
        if event == "call":
            files.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        yield files
    finally:
        sys.setprofile(None)


def _tuple(out: object) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", CASES)
def test_plain_call_skips_the_python_autograd_kernel(name: str) -> None:
    ours, _registered, make = _cases()[name]
    args = make()
    ours(*args)  # builds and binds
    with python_calls() as files:
        out = _tuple(ours(*args))
    assert not [f for f in files if f.endswith("_library/autograd.py")]
    assert all(o.grad_fn is None and not o.requires_grad for o in out)
    with python_calls() as files:
        _registered(*args)
    # The registered op's Autograd kernel: its Python formula, or the C++ glue's where that was at hand when the
    # formulas were first needed (opbuilder.torchop.cxx_autograd.registered). The probe sees the former.
    python_kernel = "glue.cpp" not in torch._C._dispatch_dump(_REGISTERED_NAME[name]())
    assert bool([f for f in files if f.endswith("_library/autograd.py")]) == python_kernel, (python_kernel, files)


class _Calls(TorchDispatchMode):
    """The name (with the overload) of every op that reaches the dispatcher below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.append(func.name().split("::")[-1])
        return func(*args, **(kwargs or {}))


# name -> the registered op (an OpOverloadPacket) and which of its outputs the function returns
_PACKETS: dict[str, tuple[str, str, slice]] = {
    "relu": ("opbuilder.ops.relu", "relu", slice(None)),
    "softmax": ("opbuilder.ops.softmax", "forward", slice(None)),
    "fused_relu_layernorm": ("opbuilder.ops.fused_relu_layernorm", "fused_relu_layernorm", slice(0, 1)),
    "fused_add_rmsnorm": ("opbuilder.ops.fused_add_rmsnorm", "fused_add_rmsnorm", slice(None)),
    "rms_norm": ("opbuilder.ops.fused_add_rmsnorm", "rms_norm", slice(None)),
    "fused_matmul_add_relu": ("opbuilder.ops.fused_matmul_add_relu", "fused_matmul_add_relu", slice(None)),
}


def _packet(name: str) -> tuple[torch._ops.OpOverloadPacket, slice]:
    module, op, outputs = _PACKETS[name]
    return getattr(sys.modules[module]._ops(), op), outputs


def _extra(name: str) -> tuple:
    """The arguments after the tensors that the registered op takes (eps)."""
    return {"fused_relu_layernorm": (1e-5,), "fused_add_rmsnorm": (1e-6,), "rms_norm": (1e-6,)}.get(name, ())


# The op below a call that needs a gradient (inside the Function): the nograd overload where it returns
# what the registered op returns, else the registered op itself (LayerNorm's statistics, relu's mask).
_GRAD_CALLS = {"relu": "relu_mask.nograd", "fused_relu_layernorm": "fused_relu_layernorm"}


@pytest.mark.parametrize("name", CASES)
def test_plain_call_runs_the_nograd_overload(name: str) -> None:
    ours, _registered, make = _cases()[name]
    args = make()
    ours(*args)
    op = _PACKETS[name][1]
    with _Calls() as calls:
        ours(*args)
    assert calls.names == [f"{op}.nograd"]
    with _Calls() as calls:
        ours(*[t.requires_grad_() for t in args])
    # (save_for_backward of an output detaches it)
    assert [n for n in calls.names if n != "detach"] == [_GRAD_CALLS.get(name, f"{op}.nograd")], calls.names


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nograd_overload_is_the_registered_op_without_autograd(name: str, dtype: torch.dtype) -> None:
    _ours, _registered, make = _cases()[name]
    packet, outputs = _packet(name)
    assert "nograd" in packet.overloads()
    args = [t.to(dtype) for t in make()]
    if args[0].dim() == 2 and name != "fused_matmul_add_relu":
        args[0] = torch.randn(args[0].shape[1], args[0].shape[0], dtype=dtype).t()  # strided input
    full = (*args, *_extra(name))
    want = _tuple(packet.default(*full))[outputs]
    got = _tuple(packet.nograd(*full))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert g.is_contiguous() and not g.requires_grad
    # the meaning, against float64 torch
    ref = {
        "relu": lambda x: torch.relu(x),
        "softmax": lambda x: torch.softmax(x, -1),
        "fused_relu_layernorm": lambda x, w, b: torch.nn.functional.layer_norm(torch.relu(x), x.shape[-1:], w, b, 1e-5),
        "fused_add_rmsnorm": lambda a, r, w: (torch.nn.functional.rms_norm(a + r, a.shape[-1:], w, 1e-6), a + r),
        "rms_norm": lambda a, w: torch.nn.functional.rms_norm(a, a.shape[-1:], w, 1e-6),
        "fused_matmul_add_relu": lambda a, b, c: torch.relu(a @ b + c),
    }[name](*[t.double() for t in args])
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for g, r in zip(got, _tuple(ref)):
        torch.testing.assert_close(g.double(), r, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", CASES)
def test_nograd_overload_opcheck_and_compile(name: str) -> None:
    _ours, _registered, make = _cases()[name]
    packet, _ = _packet(name)
    full = (*make(), *_extra(name))
    torch.library.opcheck(packet.nograd, full)
    fn = torch.compile(lambda *a: packet.nograd(*a), backend="aot_eager", fullgraph=True)
    for g, w in zip(_tuple(fn(*full)), _tuple(packet.nograd(*full))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.fixture
def python_grad_path() -> Iterator[None]:
    """The Python gradient path (autograd.Function), which the tests below are about; the C++ one is
    tests/test_cxx_autograd.py's."""
    from opbuilder.torchop import cxx_autograd

    with cxx_autograd.disabled():
        yield


@pytest.mark.parametrize("name", CASES)
def test_grad_call_uses_the_registered_formula(name: str, python_grad_path: None) -> None:
    ours, registered, make = _cases()[name]
    args = [t.requires_grad_() for t in make()]
    out = _tuple(ours(*args))
    assert type(out[0].grad_fn).__name__.startswith("Eager_"), type(out[0].grad_fn).__name__
    want = _tuple(registered(*args))
    assert not type(want[0].grad_fn).__name__.startswith("Eager_")
    grads_out = [torch.randn_like(o) for o in out]
    got_grads = torch.autograd.grad(out, args, grads_out, allow_unused=True)
    want_grads = torch.autograd.grad(want, args, grads_out, allow_unused=True)
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.autograd.gradcheck(lambda *a: ours(*a), args)


def test_double_backward_through_the_eager_function(python_grad_path: None) -> None:
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    assert type(ops.softmax(x).grad_fn).__name__.startswith("Eager_")
    torch.autograd.gradgradcheck(ops.softmax, (x,))


def test_no_grad_mode_and_inputs_without_grad_take_the_plain_call() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        y = ops.relu(x)
    assert y.grad_fn is None and not y.requires_grad
    with torch.inference_mode():
        assert ops.softmax(torch.randn(3, 4)).is_inference()


def test_other_contexts_take_the_registered_op(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    assert eager.direct()
    # autocast: the Function is not used (an autocast rule must cast before autograd sees the inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not type(ops.softmax(x).grad_fn).__name__.startswith("Eager_")
    # functorch transforms
    got = torch.func.vmap(ops.relu)(x.detach())
    torch.testing.assert_close(got, torch.relu(x.detach()))
    with monkeypatch.context() as m:  # inside a transform, direct() is False
        seen = []
        m.setattr(eager, "direct", lambda: seen.append(_DIRECT()) or seen[-1])
        torch.func.vmap(ops.softmax)(x.detach())
        assert seen == [False]
    # forward AD: the registered op, whatever it does with dual tensors (no silent loss of the tangent)
    with fwAD.dual_level():
        assert not eager.direct()
        dual = fwAD.make_dual(x.detach(), torch.ones(3, 4))
        try:
            tangent = fwAD.unpack_dual(ops.relu(dual)).tangent
        except RuntimeError:
            tangent = "raised"
        try:
            want_tangent = fwAD.unpack_dual(sys.modules["opbuilder.ops.relu"].relu_op()(dual)).tangent
        except RuntimeError:
            want_tangent = "raised"
        assert (tangent is None) == (want_tangent is None) and type(tangent) is type(want_tangent)
    # Dynamo: is_compiling() is True while tracing, so the compiled graph calls the registered op
    monkeypatch.setattr(eager, "_IS_COMPILING", lambda: True)
    assert not eager.direct()
    assert not type(ops.relu(x).grad_fn).__name__.startswith("Eager_")


def test_autocast_keeps_the_function_where_the_op_has_no_autocast_rule(python_grad_path: None) -> None:
    relu_mod = sys.modules["opbuilder.ops.relu"]
    x = torch.randn(3, 4, requires_grad=True)
    ops.relu(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.relu(x)  # relu_mask has no autocast rule: autocast would pass the registered op by too
        want = relu_mod.relu_mask_op()(x)[0]
    assert type(y.grad_fn).__name__.startswith("Eager_") and y.dtype == want.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    # softmax has one (CUDA's float32 rule): with a gradient, its registered op under any autocast
    assert not eager._has_autocast_rule(relu_mod.relu_mask_op()._schema.name)
    softmax_op = sys.modules["opbuilder.ops.softmax"].forward_op()
    assert eager._has_autocast_rule(softmax_op._schema.name) and eager._has_autocast_rule(softmax_op._schema.name + ".nograd")


def test_compiled_call_records_the_registered_op() -> None:
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    x = torch.randn(3, 8)
    fn = torch.compile(lambda t: ops.softmax(ops.relu(t)), backend=counter, fullgraph=True)
    torch.testing.assert_close(fn(x), torch.softmax(torch.relu(x), -1))
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any(".relu.default" in t for t in targets) and any(".forward.default" in t for t in targets), targets


@pytest.mark.parametrize("schema", ["kwonly(Tensor x, *, Tensor s) -> Tensor", "mutates(Tensor(a!) x) -> Tensor(a!)"],
                         ids=["kwarg_only_tensor", "mutating"])
def test_python_formula_refuses_what_torch_library_refuses(schema: str) -> None:
    """register_queued's formulas are torch.library's Autograd kernel (make_autograd_impl) in a wrapper: the
    schemas torch.library.register_autograd refuses must still be refused, not registered. A kwarg-only Tensor
    goes beside the generated Function (it got no gradient, without a word: s.grad None); a mutating op's
    Function does not know of the mutation (a gradient through the mutated tensor came out 12, not 22)."""
    ns = f"opb_test_refused_{schema.partition('(')[0]}"
    lib = torch.library.Library(ns, "DEF")
    lib.define(schema)
    name = schema.partition("(")[0]
    lib.impl(name, (lambda x, *, s: x * s) if name == "kwonly" else (lambda x: x.mul_(2)), "CPU")
    try:
        eager.register_autograd(f"{ns}::{name}", lambda ctx, g: (g,), setup_context=lambda *a, **k: None)
        with pytest.raises((RuntimeError, NotImplementedError), match="register_autograd|Cannot register autograd"):
            eager.register_queued(ns)
    finally:
        eager._QUEUED.pop(ns, None)
        eager._AUTOGRAD.pop(f"{ns}::{name}", None)
        lib._destroy()


@pytest.mark.parametrize("has_is_out", [True, False], ids=["torch 2.13 on", "torch 2.10 to 2.12"])
def test_python_formula_registers_on_a_torch_without_is_out(has_is_out: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch._library.utils.is_out`` came with torch 2.13; the project supports torch 2.10 on (pyproject), where
    every op's Python formula failed to register with an AttributeError (8 CUDA tests failed on torch 2.11)."""
    import types

    import torch._library
    from torch._library import utils

    if not has_is_out:  # what opbuilder's import of torch._library.utils gets (torch's own modules keep theirs)
        older = {k: getattr(utils, k) for k in dir(utils) if k != "is_out" and not k.startswith("__")}
        monkeypatch.setattr(torch._library, "utils", types.SimpleNamespace(**older))
    elif not hasattr(utils, "is_out"):
        pytest.skip("this torch has no torch._library.utils.is_out")
    ns = "opb_test_formula_is_out"
    lib = torch.library.Library(ns, "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    try:
        eager.register_autograd(f"{ns}::twice", lambda ctx, g: g * 2, setup_context=lambda *a, **k: None)
        eager.register_queued(ns)
        x = torch.ones(3, requires_grad=True)
        getattr(torch.ops, ns).twice(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    finally:
        eager._QUEUED.pop(ns, None)
        eager._AUTOGRAD.pop(f"{ns}::twice", None)
        eager._FORMULAS.pop(ns, None)
        lib._destroy()


@pytest.mark.parametrize("name", CASES)
def test_forward_ad_of_vmap_is_refused_naming_the_op(name: str) -> None:
    """jvp of vmap: the functions' own refusal read the tangent of a vmap-batched tensor, where unpack_dual has no
    batching rule ("Batching rule not implemented for aten::_unpack_dual", naming no op); the refusal leaves such
    a tensor to the registered op, which refuses the tangent below the transform, with the op's name."""
    fn, registered, make = _cases()[name]
    batched = [a.unsqueeze(0).expand(2, *a.shape).contiguous() for a in make()]
    for f in (fn, registered):
        with pytest.raises(NotImplementedError, match="forward AD with opbuilder's"):
            torch.func.jvp(torch.func.vmap(f), tuple(batched), tuple(torch.ones_like(a) for a in batched))


def test_an_error_reading_a_tangent_other_than_vmaps_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a vmap-batched tensor's tangent is left to the op below the transform; any other error of
    unpack_dual is the caller's to see (every RuntimeError was taken for "no tangent", and the op ran on)."""
    from opbuilder.torchop import once

    def unreadable(t: torch.Tensor) -> None:
        raise RuntimeError("the tangent could not be read")

    monkeypatch.setattr(once.forward_ad, "unpack_dual", unreadable)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="the tangent could not be read"):
        once.refuse_forward_ad("relu", torch.ones(2))
