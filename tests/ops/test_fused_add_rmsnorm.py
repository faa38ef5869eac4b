"""fused_add_rmsnorm and rms_norm: values and gradients against a float64 reference, the rounded-h
numerics, odd/empty/non-contiguous shapes, bad input, opcheck, gradcheck, torch.compile, autocast,
the layers, and (on the GPU machine) every launch path and CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from helpers import DEVICES, requires_cuda
from helpers.reference import TOLERANCES, assert_close_to_ref

from opbuilder.ops.fused_add_rmsnorm import (
    FusedAddRMSNorm,
    RMSNorm,
    fused_add_rmsnorm,
    fused_add_rmsnorm_backward_op,
    fused_add_rmsnorm_op,
    rms_norm,
    rms_norm_op,
)

EPS = 1e-6
LOW = (torch.float16, torch.bfloat16)

# (shape, dtypes): the hidden sizes and row counts, combined so the CPU run stays short.
SHAPES = [
    (1, 1),
    (3, 7),
    (1000, 111),
    (3, 4095),
    (1000, 4096),
    (3, 4097),
    (1, 65536),
    (2, 3, 111),  # leading dims flatten to rows
]
# On the GPU, also a shape for each launch configuration: rows per warp (hidden/8 packs <= 32), a warp
# per row, a block per row with 1..8 packs a thread, the loop kernels (too long for registers), and
# hidden not a multiple of the 16-byte pack.
CUDA_SHAPES = [
    (1000, 8),
    (1000, 24),
    (1000, 64),
    (1000, 256),
    (1000, 512),
    (1000, 1024),
    (513, 2048),
    (257, 5120),
    (130, 8192),
    (67, 16384),
    (9, 32768),
    (5, 131072),
    (1000, 4100),
    (7, 65538),
]


def _dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.float16, torch.bfloat16] + ([torch.float64] if device == "cpu" else [])


def _cases(shapes):
    return [(d, s, t) for d in DEVICES for s in shapes for t in _dtypes(d)]


def _case_id(case) -> str:
    device, shape, dtype = case
    return f"{device}-{'x'.join(map(str, shape))}-{str(dtype).split('.')[-1]}"


def rounded_h(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x + r rounded once to x's dtype, as float64."""
    return (x.double() + r.double()).to(x.dtype).double()


def ref_norm(h64: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def make(shape, dtype, device, scale=1.0, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
    r = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
    w = (1 + 0.5 * torch.randn(hidden, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)
    for t in (x, r, w):
        t.requires_grad_(requires_grad)
    return x, r, w


# ---- forward values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", _cases(SHAPES) + [c for c in _cases(CUDA_SHAPES) if c[0] == "cuda"], ids=_case_id)
def test_forward_matches_float64_reference(case):
    device, shape, dtype = case
    x, r, w = make(shape, dtype, device)
    out, res = fused_add_rmsnorm(x, r, w, EPS)
    h64 = rounded_h(x, r)
    assert_close_to_ref(res, x.double() + r.double(), dtype)
    assert_close_to_ref(out, ref_norm(h64, w), dtype)
    assert out.is_contiguous() and res.is_contiguous()
    # The residual-free path: the norm of the same h.
    assert_close_to_ref(rms_norm(res, w, EPS), ref_norm(h64, w), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
def test_norm_is_taken_of_the_rounded_residual_out(device, dtype):
    """out == rms_norm(residual_out) to the last bit, not the norm of the unrounded fp32 sum: checked
    where the two differ (the second reference must disagree, or the test could not tell them apart)."""
    x, r, w = make((64, 1024), dtype, device, seed=3)
    out, res = fused_add_rmsnorm(x, r, w, EPS)
    from_rounded = ref_norm(res.double(), w).to(dtype)
    from_exact = ref_norm(x.double() + r.double(), w).to(dtype)
    same_rounded = (out.cpu() == from_rounded.cpu()).float().mean().item()
    same_exact = (out.cpu() == from_exact.cpu()).float().mean().item()
    assert same_rounded > 0.995, f"only {same_rounded:.4f} of out equals rms_norm(residual_out) rounded once"
    assert same_exact < 0.95, "the test inputs do not tell the rounded and the exact h apart"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [3e4, 1e15])
def test_bf16_large_magnitudes(device, scale):
    x, r, w = make((64, 4096), torch.bfloat16, device, scale=scale, seed=5)
    out, res = fused_add_rmsnorm(x, r, w, EPS)
    assert torch.isfinite(out).all()
    assert_close_to_ref(res, x.double() + r.double(), torch.bfloat16)
    assert_close_to_ref(out, ref_norm(rounded_h(x, r), w), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 16), (4, 0), (2, 0, 8), (0,)])
def test_empty(device, shape):
    x, r, w = make(shape, torch.float32, device, requires_grad=True)
    out, res = fused_add_rmsnorm(x, r, w, EPS)
    assert out.shape == res.shape == x.shape
    (out.sum() + res.sum()).backward()
    assert x.grad.shape == x.shape and r.grad.shape == r.shape
    assert w.grad.shape == w.shape and (w.grad == 0).all()
    assert rms_norm(x.detach(), w.detach(), EPS).shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_and_offset_inputs(device, dtype):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(300, 64, generator=g).to(device=device, dtype=dtype)
    x = base.t()  # [64, 300], transposed
    r = torch.randn(64, 600, generator=g).to(device=device, dtype=dtype)[:, ::2]  # strided
    w = torch.randn(600, generator=g).to(device=device, dtype=dtype)[::2]
    out, res = fused_add_rmsnorm(x, r, w, EPS)
    assert_close_to_ref(res, x.double() + r.double(), dtype)
    assert_close_to_ref(out, ref_norm(rounded_h(x, r), w), dtype)
    # Contiguous views that start off a 16-byte boundary (the GPU kernels load 16 bytes at a time).
    flat = torch.randn(2 * 40 * 512 + 1, generator=g).to(device=device, dtype=dtype)
    xo = flat[1 : 1 + 40 * 512].view(40, 512)
    ro = flat[40 * 512 + 1 :].view(40, 512)
    wo = torch.randn(513, generator=g).to(device=device, dtype=dtype)[1:]
    out, res = fused_add_rmsnorm(xo, ro, wo, EPS)
    assert_close_to_ref(out, ref_norm(rounded_h(xo, ro), wo), dtype)
    gy = torch.randn(40, 512, generator=g).to(device=device, dtype=dtype)
    gi, gw = fused_add_rmsnorm_backward_op()(gy, None, xo, wo, EPS)
    gi2, gw2 = fused_add_rmsnorm_backward_op()(gy, None, xo.clone(), wo.clone(), EPS)
    torch.testing.assert_close(gi, gi2)
    torch.testing.assert_close(gw, gw2)


# ---- backward ------------------------------------------------------------------------------------------


def reference_grads(x, r, w, gy, gr, eps=EPS):
    """Float64 gradients of (out, residual_out) with h = x + r rounded in the forward and the rounding
    passed straight through in the backward."""
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    exact = x64 + r64
    h = exact + (rounded_h(x.detach(), r.detach()) - exact).detach()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w64
    outs, grads = [out], [gy.double()]
    if gr is not None:
        outs.append(h)
        grads.append(gr.double())
    torch.autograd.backward(outs, grads)
    return x64.grad, r64.grad, w64.grad


BACKWARD_SHAPES = [(3, 7), (1000, 111), (64, 4096), (3, 4097), (2, 65536), (2, 3, 111)]
CUDA_BACKWARD_SHAPES = [(1000, 8), (1000, 64), (1000, 512), (1000, 1024), (129, 2048), (257, 8192), (33, 16384)]


@pytest.mark.parametrize(
    "case", _cases(BACKWARD_SHAPES) + [c for c in _cases(CUDA_BACKWARD_SHAPES) if c[0] == "cuda"], ids=_case_id
)
@pytest.mark.parametrize("with_residual_grad", [True, False], ids=["both_outputs", "out_only"])
def test_backward_matches_float64_reference(case, with_residual_grad):
    device, shape, dtype = case
    x, r, w = make(shape, dtype, device, requires_grad=True, seed=11)
    g = torch.Generator().manual_seed(12)
    gy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    gr = torch.randn(shape, generator=g).to(device=device, dtype=dtype) if with_residual_grad else None
    out, res = fused_add_rmsnorm(x, r, w, EPS)
    if gr is not None:
        torch.autograd.backward([out, res], [gy, gr])
    else:
        out.backward(gy)
    ex, er, ew = reference_grads(x, r, w, gy, gr)
    # Gradients pass through two reductions; the weight's sums over all rows.
    scale = 2.0 if dtype in LOW else 1.0
    assert_close_to_ref(x.grad, ex, dtype, scale)
    assert_close_to_ref(r.grad, er, dtype, scale)
    assert_close_to_ref(w.grad, ew, dtype, scale * 4)


class _OpsCalled(TorchDispatchMode):
    """Records the name of every op (with its overload) that runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _backward_ops_and_copies(out: torch.Tensor, res: torch.Tensor) -> tuple[list[str], set[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, _OpsCalled() as ops:
        torch.autograd.backward([out, res], [torch.randn_like(out), torch.randn_like(res)])
    backward = [n for n in ops.names if "fused_add_rmsnorm_backward" in n]
    return backward, {e.key for e in prof.key_averages()} & {"aten::clone", "aten::copy_"}


def test_leaf_inputs_get_two_gradients_without_a_copy():
    """Input and residual leaves get two gradient tensors, both written by the backward op: handed one
    tensor for both, autograd would clone it (a full read and write, more than a second write)."""
    x, r, w = make((16, 64), torch.float32, "cpu", requires_grad=True)
    backward, copies = _backward_ops_and_copies(*fused_add_rmsnorm(x, r, w, EPS))
    assert [n.rsplit(".", 1)[-1] for n in backward] == ["two_grads"]
    assert not copies, f"the backward copied a gradient: {copies}"
    assert x.grad.data_ptr() != r.grad.data_ptr()
    torch.testing.assert_close(x.grad, r.grad, rtol=0, atol=0)


def test_inputs_made_by_earlier_ops_share_one_gradient():
    """Inside a model the two input gradients flow on to other ops, which only read them: one tensor
    serves both (no second write, and autograd copies nothing)."""
    x0, r0, w = make((16, 64), torch.float32, "cpu", requires_grad=True)
    x, r = x0.exp(), r0.exp()  # their backward multiplies; nothing else there copies
    backward, copies = _backward_ops_and_copies(*fused_add_rmsnorm(x, r, w, EPS))
    assert [n.rsplit(".", 1)[-1] for n in backward] == ["default"]
    assert not copies, f"the backward copied a gradient: {copies}"
    torch.testing.assert_close(x0.grad / x.detach(), r0.grad / r.detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_backward_matches_torch(device):
    x = torch.randn(50, 300, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, device=device, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(50, 300, device=device, dtype=torch.float64)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm(x, w, EPS).backward(gy)
    F.rms_norm(x2, (300,), w2, EPS).backward(gy)
    assert_close_to_ref(x.grad, x2.grad, torch.float64)
    assert_close_to_ref(w.grad, w2.grad, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_without_residual_grad_equals_zero_residual_grad(device):
    x, r, w = make((100, 256), torch.float32, device, seed=2)
    h = (x + r).contiguous()
    gy = torch.randn_like(h)
    a = fused_add_rmsnorm_backward_op()(gy, None, h, w, EPS)
    b = fused_add_rmsnorm_backward_op()(gy, torch.zeros_like(h), h, w, EPS)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradcheck_float64_both_outputs():
    for shape in [(3, 7), (2, 3, 5), (1, 1)]:
        x, r, w = make(shape, torch.float64, "cpu", requires_grad=True, seed=4)
        assert torch.autograd.gradcheck(lambda a, b, c: fused_add_rmsnorm(a, b, c, 1e-5), (x, r, w))
        assert torch.autograd.gradcheck(lambda a, c: rms_norm(a, c, 1e-5), (x, w))
        # Only one output used: the other's gradient comes in as zeros.
        assert torch.autograd.gradcheck(lambda a, b, c: fused_add_rmsnorm(a, b, c, 1e-5)[0], (x, r, w))
        assert torch.autograd.gradcheck(lambda a, b, c: fused_add_rmsnorm(a, b, c, 1e-5)[1], (x, r, w))


# ---- registration -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, r, w = make((5, 40), torch.float32, device, requires_grad=True, seed=9)
    torch.library.opcheck(fused_add_rmsnorm_op(), (x, r, w, EPS))
    torch.library.opcheck(rms_norm_op(), (x, w, EPS))
    xd, rd, wd = make((2, 3, 24), torch.float32, device, seed=10)
    torch.library.opcheck(fused_add_rmsnorm_op(), (xd, rd, wd, EPS))
    gy, gr = torch.randn_like(xd), torch.randn_like(xd)
    torch.library.opcheck(fused_add_rmsnorm_backward_op(), (gy, gr, xd, wd, EPS))
    torch.library.opcheck(fused_add_rmsnorm_backward_op(), (gy, None, xd, wd, EPS))
    two_grads = fused_add_rmsnorm_backward_op().overloadpacket.two_grads
    torch.library.opcheck(two_grads, (gy, gr, xd, wd, EPS))
    torch.library.opcheck(two_grads, (gy, None, xd, wd, EPS))


class _Block(torch.nn.Module):
    """A pre-norm residual step using both layers."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm_in = RMSNorm(hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm_add = FusedAddRMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm_in(x))
        normed, residual = self.norm_add(h, x)
        return normed * 2 + residual


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_matches_eager(device):
    torch.manual_seed(0)
    model = _Block(64).to(device)
    with torch.no_grad():
        model.norm_in.weight.normal_()
        model.norm_add.weight.normal_()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 5, 64, device=device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye = model(x1)
    ye.square().sum().backward()
    grads_eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    yc = compiled(x2)
    yc.square().sum().backward()
    torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    for p, ge in zip(model.parameters(), grads_eager):
        torch.testing.assert_close(p.grad, ge, rtol=1e-5, atol=1e-5)


# ---- layers ---------------------------------------------------------------------------------------------


def test_layers_parameters_like_torch_rmsnorm():
    for layer in (FusedAddRMSNorm(48), RMSNorm(48, eps=1e-5)):
        assert list(layer.state_dict()) == ["weight"]
        assert torch.equal(layer.weight.detach(), torch.ones(48))
    torch_norm = torch.nn.RMSNorm(48, eps=1e-6)
    ours = RMSNorm(48)
    ours.load_state_dict(torch_norm.state_dict())
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        RMSNorm(0)


def _norms_with_one_weight(hidden: int, device: str) -> tuple[torch.nn.RMSNorm, FusedAddRMSNorm, RMSNorm]:
    """torch.nn.RMSNorm with a random weight, and our two layers holding the same weight."""
    torch_norm = torch.nn.RMSNorm(hidden, eps=1e-6).to(device)
    fused, plain = FusedAddRMSNorm(hidden).to(device), RMSNorm(hidden).to(device)
    with torch.no_grad():
        torch_norm.weight.normal_()
        fused.weight.copy_(torch_norm.weight)
        plain.weight.copy_(torch_norm.weight)
    return torch_norm, fused, plain


@pytest.mark.parametrize("device", DEVICES)
def test_layers_match_torch_rmsnorm(device):
    torch.manual_seed(1)
    torch_norm, fused, plain = _norms_with_one_weight(128, device)
    x = torch.randn(3, 10, 128, device=device, requires_grad=True)
    r = torch.randn(3, 10, 128, device=device, requires_grad=True)
    normed, new_residual = fused(x, r)
    expected_res = x + r
    expected = torch_norm(expected_res)
    torch.testing.assert_close(new_residual, expected_res)
    torch.testing.assert_close(normed, expected)
    torch.testing.assert_close(plain(x), torch_norm(x))
    gy = torch.randn_like(normed)
    ours = torch.autograd.grad((normed * gy).sum() + new_residual.sum(), [x, r, fused.weight])
    theirs = torch.autograd.grad((expected * gy).sum() + expected_res.sum(), [x, r, torch_norm.weight])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_layers_under_autocast_match_torch(device, in_dtype):
    """Under bf16 autocast the layers give what torch.nn.RMSNorm applied to x + residual gives: same
    dtypes (float32 norm on CUDA, the input's dtype on CPU) and values."""
    torch.manual_seed(2)
    torch_norm, fused, plain = _norms_with_one_weight(256, device)
    x = torch.randn(8, 256, device=device).to(in_dtype)
    r = torch.randn(8, 256, device=device).to(in_dtype)
    with torch.autocast(device, dtype=torch.bfloat16):
        normed, new_residual = fused(x, r)
        expected_res = x + r
        expected = torch_norm(expected_res)
        plain_out, plain_expected = plain(x), torch_norm(x)
    for ours, theirs in ((normed, expected), (new_residual, expected_res), (plain_out, plain_expected)):
        assert ours.dtype == theirs.dtype, f"dtype {ours.dtype}, torch gives {theirs.dtype}"
        rtol, atol = TOLERANCES[in_dtype]
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol)


# ---- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grad", [False, True])
def test_bad_input_names_argument_expected_and_got(grad):
    x, r, w = make((3, 8), torch.float32, "cpu")
    # Loaded and dispatched first: the calls below take the usual path, where the C++ op checks the inputs
    # and the named errors come from the Python checks only once it has refused them; with a gradient too.
    fused_add_rmsnorm(x, r, w)
    rms_norm(x, w)
    x.requires_grad_(grad)
    with pytest.raises(TypeError, match="^fused_add_rmsnorm: residual must have input's dtype torch.float32, got"):
        fused_add_rmsnorm(x, r.half(), w)
    with pytest.raises(TypeError, match="weight must have input's dtype torch.float32, got torch.bfloat16"):
        fused_add_rmsnorm(x, r, w.bfloat16())
    with pytest.raises(ValueError, match=r"weight must be on input's device cpu, got meta"):
        fused_add_rmsnorm(x, r, w.to("meta"))
    with pytest.raises(ValueError, match=r"residual must be on input's device cpu, got meta"):
        fused_add_rmsnorm(x, r.to("meta"), w)
    big = torch.randn(2, 4096)
    with pytest.raises(
        ValueError,
        match=r"^fused_add_rmsnorm: weight must have shape \[4096\] to match input's last dim, got \[4095\]$",
    ):
        fused_add_rmsnorm(big, big, torch.ones(4095))
    with pytest.raises(ValueError, match=r"weight must have shape \[8\] to match input's last dim, got \[1, 8\]"):
        fused_add_rmsnorm(x, r, w[None])
    with pytest.raises(ValueError, match=r"residual must have input's shape \[3, 8\], got \[3, 1, 8\]"):
        fused_add_rmsnorm(x, r[:, None], w)
    with pytest.raises(TypeError, match="input must be float32, float16, bfloat16 or float64, got torch.int64"):
        fused_add_rmsnorm(x.long(), r.long(), w.long())
    with pytest.raises(TypeError, match="residual must be float32, float16, bfloat16 or float64, got torch.int32"):
        fused_add_rmsnorm(x, r.int(), w)
    with pytest.raises(ValueError, match="input must have at least 1 dimension"):
        fused_add_rmsnorm(torch.tensor(1.0), torch.tensor(1.0), torch.ones(1))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor, got list"):
        fused_add_rmsnorm(x, [1.0], w)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0, got -1"):
        fused_add_rmsnorm(x, r, w, -1.0)
    with pytest.raises(TypeError, match="eps must be a float, got str"):
        fused_add_rmsnorm(x, r, w, "1e-6")
    with pytest.raises(ValueError, match=r"^rms_norm: weight must have shape \[8\] to match input's last dim, got \[7"):
        rms_norm(x, w[:7])


def test_bad_input_to_the_raw_ops_raises_runtime_error():
    x, r, w = make((3, 8), torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"fused_add_rmsnorm: weight must have shape \[8\] to match input's"):
        fused_add_rmsnorm_op()(x, r, w[:7], EPS)
    with pytest.raises(RuntimeError, match="fused_add_rmsnorm: residual must have input's dtype Float, got Double"):
        fused_add_rmsnorm_op()(x, r.double(), w, EPS)
    with pytest.raises(RuntimeError, match="input must be float32, float16, bfloat16 or float64, got Int"):
        fused_add_rmsnorm_op()(x.int(), r.int(), w.int(), EPS)
    with pytest.raises(RuntimeError, match=r"backward: grad_out must have residual_out's shape \[3, 8\], got \[3, 7"):
        fused_add_rmsnorm_backward_op()(x[:, :7], None, x, w, EPS)
    with pytest.raises(RuntimeError, match="rms_norm: eps must be a finite number >= 0"):
        rms_norm_op()(x, w, float("nan"))


# ---- GPU only -------------------------------------------------------------------------------------------


@requires_cuda
def test_cuda_bad_device_and_determinism():
    x, r, w = make((257, 2048), torch.bfloat16, "cuda", seed=8)
    with pytest.raises(ValueError, match=r"weight must be on input's device cuda:0, got cpu"):
        fused_add_rmsnorm(x, r, w.cpu())
    with pytest.raises(RuntimeError, match=r"weight must be on input's device cuda:0, got cpu"):
        fused_add_rmsnorm_op()(x, r, w.cpu(), EPS)
    gy = torch.randn_like(x)
    first = fused_add_rmsnorm_backward_op()(gy, gy, x, w, EPS)
    second = fused_add_rmsnorm_backward_op()(gy, gy, x, w, EPS)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@requires_cuda
@pytest.mark.parametrize("hidden", [1024, 4097])
def test_cuda_graph_capture_and_replay_forward_backward(hidden):
    g = torch.Generator().manual_seed(6)

    def rand(*shape):
        return torch.randn(*shape, generator=g).cuda()

    x, r, w = rand(96, hidden), rand(96, hidden), rand(hidden)
    for t in (x, r, w):
        t.requires_grad_()
    gy, gr = rand(96, hidden), rand(96, hidden)

    def step():
        out, res = fused_add_rmsnorm(x, r, w, EPS)
        torch.autograd.backward([out, res], [gy, gr])
        return out, res

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            x.grad = r.grad = w.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = r.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = step()

    for _ in range(2):  # new data in the captured buffers, then replay
        with torch.no_grad():
            for t in (x, r, w, gy, gr):
                t.copy_(rand(*t.shape))
        graph.replay()
        torch.cuda.synchronize()
        xe, re, we = (t.detach().clone().requires_grad_() for t in (x, r, w))
        oe, rese = fused_add_rmsnorm(xe, re, we, EPS)
        torch.autograd.backward([oe, rese], [gy, gr])
        torch.testing.assert_close(out, oe)
        torch.testing.assert_close(res, rese)
        torch.testing.assert_close(x.grad, xe.grad)
        torch.testing.assert_close(r.grad, re.grad)
        torch.testing.assert_close(w.grad, we.grad)


@pytest.mark.parametrize("rows,hidden", [(64, 64), (7, 300), (200, 33)])
def test_small_cpu_backward_does_not_depend_on_the_thread_count(rows, hidden):
    # A small input's weight gradient is summed on one thread: waking the pool would cost more than the
    # work (and a scheduler's time slice on a busy machine). One chunk also means one summation order,
    # whatever torch.get_num_threads() is: bit-for-bit the same gradient with 1 and 2 threads.
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g)
    grad = torch.randn(rows, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)

    def weight_grad(threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            w = weight.clone().requires_grad_()
            rms_norm(x, w).backward(grad)
            return w.grad
        finally:
            torch.set_num_threads(before)

    assert torch.equal(weight_grad(1), weight_grad(2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_residual_out_rounds_as_torch_on_every_bit_pattern(device: str, dtype: torch.dtype) -> None:
    # residual_out is input + residual in float, rounded to the 16-bit type: on the CPU the rows go to float and
    # back many at a time (kernels/common/cpu_rows.h), so every pattern (subnormals, infinities, NaNs) and
    # rounding both ways must come out as torch's own conversions give it. Rows of 4099: a partial group of 8.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = torch.cat([bits, bits[:4099 * 17 - bits.numel()]]).view(dtype).view(17, 4099).to(device)
    g = torch.Generator().manual_seed(0)
    r = (torch.randn(17, 4099, generator=g) * torch.logspace(-8, 4, 4099)).to(dtype).to(device)
    w = torch.ones(4099, dtype=dtype, device=device)
    _, h = fused_add_rmsnorm(x, r, w)
    want = (x.float() + r.float()).to(dtype)
    same = (h.view(torch.int16) == want.view(torch.int16)) | (torch.isnan(h) & torch.isnan(want))
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()}: got {h[~same][:4]}, want {want[~same][:4]}"
