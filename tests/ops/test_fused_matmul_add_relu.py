"""fused_matmul_add_relu and FusedLinearReLU against a float64 reference, on every device."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import DEVICES, requires_cuda, run_python
from torch import nn

from opbuilder.ops.fused_matmul_add_relu import (
    FusedLinearReLU,
    fused_matmul_add_relu,
    fused_matmul_add_relu_op,
    relu_bias_backward_op,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

# The MMA-style error rule. Each output is a K-term dot product accumulated in fp32 (fp64 for
# float64), then rounded to the output type once (CUDA epilogue) or twice (CPU: GEMM, then bias):
#   |out - ref| <= 2 u_out (|lhs @ rhs| + |bias|) + C u_acc sqrt(K) sqrt(lhs^2 @ rhs^2)
# The second term is the accumulation error's random-walk growth with K. A wrong transpose, batch,
# bias or mask gives errors of the size of the values themselves, far above either term.
U_OUT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
U_ACC = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-24}
U_TF32 = 2.0**-10  # TF32 rounds each input to 10 mantissa bits
ACC_FACTOR = 16.0


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double().cpu()


def assert_within(actual: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, spread: torch.Tensor, terms: int,
                  dtype: torch.dtype, u_acc: float | None = None) -> None:
    """``actual`` against the float64 ``ref`` with the bound above; ``mag`` and ``spread`` as there."""
    assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {dtype}"
    assert tuple(actual.shape) == tuple(ref.shape), f"shape {tuple(actual.shape)}, expected {tuple(ref.shape)}"
    u_acc = U_ACC[dtype] if u_acc is None else u_acc
    bound = 2 * U_OUT[dtype] * mag + ACC_FACTOR * u_acc * math.sqrt(max(terms, 1)) * spread + 1e-300
    err = (actual.detach().double().cpu() - ref).abs()
    bad = ~(err <= bound)
    if bad.any():
        i = int(torch.argmax(torch.where(bad, err / bound, torch.zeros_like(err))))
        raise AssertionError(
            f"{int(bad.sum())} of {err.numel()} elements out of bounds; worst at flat index {i}: "
            f"got {actual.reshape(-1)[i].item():.6g}, expected {ref.reshape(-1)[i].item():.6g}, "
            f"error {err.reshape(-1)[i].item():.3g} > bound {bound.reshape(-1)[i].item():.3g}"
        )


def check_forward(out: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None,
                  u_acc: float | None = None) -> None:
    l64, r64, b64 = _f64(lhs), _f64(rhs), _f64(bias)
    mm = l64 @ r64
    ref = (mm if b64 is None else mm + b64).relu()
    mag = mm.abs() if b64 is None else mm.abs() + b64.abs()
    spread = ((l64 * l64) @ (r64 * r64)).sqrt()
    assert out.device == lhs.device
    assert out.is_contiguous()
    assert_within(out, ref, mag, spread, lhs.shape[-1], lhs.dtype, u_acc)


def make(shape, device, dtype, requires_grad=False):
    return torch.randn(shape, device=device, dtype=dtype, requires_grad=requires_grad)


# ---- forward ------------------------------------------------------------------------------------

SHAPES_2D = [(1, 1, 1), (7, 111, 1), (1, 7, 111), (111, 1, 7), (7, 7, 4097), (111, 111, 111), (4097, 7, 7),
             (7, 4097, 111)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mnk", SHAPES_2D, ids=lambda s: "x".join(map(str, s)))
def test_2d_vector_bias(device, dtype, mnk):
    m, n, k = mnk
    torch.manual_seed(m * 7 + n * 3 + k)
    lhs, rhs, bias = make((m, k), device, dtype), make((k, n), device, dtype), make((n,), device, dtype)
    check_forward(fused_matmul_add_relu(lhs, rhs, bias), lhs, rhs, bias)


# (lhs shape, rhs shape, bias shape or None): batching, broadcast batch dims on either side, and
# every bias form: full, vector, [M, 1], [1], 0-d, [M, N] over a batch, per-batch vector.
BATCHED = [
    ((3, 7, 111), (3, 111, 5), (3, 7, 5)),
    ((3, 7, 111), (111, 5), (5,)),
    ((3, 7, 111), (1, 111, 5), (3, 7, 5)),
    ((7, 111), (3, 111, 5), (7, 5)),
    ((1, 7, 111), (3, 111, 5), (7, 1)),
    ((3, 7, 111), (1, 111, 5), (1,)),
    ((3, 7, 111), (3, 111, 5), ()),
    ((3, 7, 111), (3, 111, 5), (3, 1, 5)),
    ((3, 7, 111), (3, 111, 5), (1, 7, 5)),
    ((3, 7, 111), (111, 5), (7, 5)),
    ((2, 7, 4097), (2, 4097, 7), (7,)),
    ((3, 1, 7), (3, 7, 1), (3, 1, 1)),
    ((3, 7, 11), (11, 5), None),
    ((7, 11), (11, 5), (7, 5)),
    ((7, 11), (11, 5), (1, 5)),
    ((7, 11), (11, 5), (7, 1)),
    ((7, 11), (11, 5), None),
    ((1, 7, 11), (11, 5), (1, 1, 5)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", BATCHED, ids=lambda s: "-".join("x".join(map(str, p)) if p is not None else "none" for p in s))
def test_batched_and_bias_forms(device, dtype, shapes):
    lhs_shape, rhs_shape, bias_shape = shapes
    torch.manual_seed(len(str(shapes)))
    lhs, rhs = make(lhs_shape, device, dtype), make(rhs_shape, device, dtype)
    bias = None if bias_shape is None else make(bias_shape, device, dtype)
    check_forward(fused_matmul_add_relu(lhs, rhs, bias), lhs, rhs, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shapes",
    [((0, 5), (5, 3), (3,)), ((4, 5), (5, 0), (0,)), ((0, 4, 5), (5, 3), (3,)), ((2, 0, 5), (2, 5, 3), (2, 1, 3)),
     ((4, 0), (0, 3), (3,)), ((4, 0), (0, 3), (4, 3)), ((2, 4, 0), (0, 3), (4, 1)), ((4, 0), (0, 3), None)],
    ids=lambda s: "-".join("x".join(map(str, p)) if p is not None else "none" for p in s),
)
def test_empty(device, dtype, shapes):
    lhs_shape, rhs_shape, bias_shape = shapes
    lhs, rhs = make(lhs_shape, device, dtype), make(rhs_shape, device, dtype)
    bias = None if bias_shape is None else make(bias_shape, device, dtype)
    out = fused_matmul_add_relu(lhs, rhs, bias)
    expected = torch.relu(lhs @ rhs + (0 if bias is None else bias))  # K = 0: relu(bias), exactly
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("python_path", [False, True], ids=["cxx", "python"])
@pytest.mark.parametrize(
    "shapes",
    [((5, 4), (1, 4, 0), (0,)), ((2, 5, 4), (4, 0), (0,)), ((2, 5, 4), (1, 4, 0), None), ((1, 5, 0), (0, 3), (3,)),
     ((5, 0), (1, 0, 3), (3,)), ((2, 0, 4), (4, 0), None), ((1, 0, 4), (1, 4, 0), None), ((0, 5, 4), (4, 3), (3,))],
    ids=lambda s: "-".join("x".join(map(str, p)) if p is not None else "none" for p in s),
)
def test_empty_backward(shapes, python_path, cxx_autograd_glue):
    """Gradients of empty inputs, on either gradient path, as torch's: rhs's gradient over an rhs shared by the
    batch flattened lhs and the upstream gradient with reshape(-1, K) and reshape(-1, N), which refuses a tensor
    of 0 elements where K or N is 0 ("the unspecified dimension size -1 can be any value")."""
    import contextlib

    from opbuilder.torchop import cxx_autograd

    lhs_shape, rhs_shape, bias_shape = shapes
    torch.manual_seed(6)
    args = [make(s, "cpu", torch.float64, requires_grad=True) for s in shapes if s is not None]
    with cxx_autograd.disabled() if python_path else contextlib.nullcontext():
        out = fused_matmul_add_relu(*args)
        assert (out.grad_fn.name() == "opbuilder::FusedMatmulAddReluBackward") is not python_path, out.grad_fn
        upstream = torch.randn_like(out)
        got = torch.autograd.grad(out, args, upstream)
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    ref = torch.relu(ref_args[0] @ ref_args[1] + (ref_args[2] if len(ref_args) == 3 else 0))
    want = torch.autograd.grad(ref, ref_args, upstream)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _noncontiguous_cases(device, dtype):
    m, n, k, b = 9, 13, 37, 3
    r = lambda *s: make(s, device, dtype)  # noqa: E731
    return {
        "lhs_transposed": (r(k, m).t(), r(k, n), r(n)),
        "rhs_transposed": (r(m, k), r(n, k).t(), r(n)),
        "both_transposed": (r(k, m).t(), r(n, k).t(), r(m, n)),
        "lhs_row_padding": (r(m, k + 5)[:, :k], r(k, n), r(n)),
        "rhs_row_padding": (r(m, k), r(k, n + 3)[:, :n], r(n)),
        "every_other_column": (r(m, 2 * k)[:, ::2], r(k, 2 * n)[:, ::2], r(2 * n)[::2]),
        "offset_storage": (r(m * k + 1)[1:].view(m, k), r(k * n + 3)[3:].view(k, n), r(n + 1)[1:]),
        "batched_transposed": (r(b, k, m).mT, r(b, n, k).mT, r(b, n, m).mT),
        "batch_expanded": (r(1, m, k).expand(b, m, k), r(b, k, n), r(n)),
        "rhs_batch_expanded": (r(b, m, k), r(1, k, n).expand(b, k, n), r(b, m, n)),
        "batch_strided": (r(2 * b, m, k)[::2], r(b, k, n), r(m, 1)),
        "bias_transposed_full": (r(m, k), r(k, n), r(n, m).t()),
        "bias_expanded": (r(m, k), r(k, n), r(1, n).expand(m, n)),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(_noncontiguous_cases("cpu", torch.float32)))
def test_noncontiguous(device, dtype, case):
    torch.manual_seed(11)
    lhs, rhs, bias = _noncontiguous_cases(device, dtype)[case]
    out = fused_matmul_add_relu(lhs, rhs, bias)
    check_forward(out, lhs, rhs, bias)
    dense = fused_matmul_add_relu(lhs.contiguous(), rhs.contiguous(), bias.contiguous())
    check_forward(dense, lhs, rhs, bias)


def test_nan_passes_through():
    lhs = torch.tensor([[1.0, float("nan")], [1.0, 1.0]])
    rhs = torch.ones(2, 2)
    out = fused_matmul_add_relu(lhs, rhs, torch.tensor([-5.0, 0.0]))
    assert out[0].isnan().all()
    assert out[1].tolist() == [0.0, 2.0]


# ---- bad input ----------------------------------------------------------------------------------

def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((_t(4, 5), _t(6, 3), _t(3)), ValueError, r"rhs must have K=5 rows to match lhs's last dim, got 6"),
        ((_t(2, 4, 5), _t(2, 6, 3), None), ValueError, r"rhs must have K=5 rows .* got 6"),
        ((_t(4, 5), _t(5, 3), _t(4)), ValueError, r"bias must broadcast to the output's shape \[4, 3\].*got \[4\]"),
        ((_t(4, 5), _t(5, 3), _t(2, 4, 3)), ValueError, r"bias must broadcast .*got \[2, 4, 3\]"),
        ((_t(4, 5), _t(5, 3), _t(4, 2)), ValueError, r"bias must broadcast"),
        ((_t(4, 5), _t(5, 3, dtype=torch.float64), None), TypeError, r"rhs must have lhs's dtype torch.float32, got torch.float64"),
        ((_t(4, 5), _t(5, 3), _t(3, dtype=torch.bfloat16)), TypeError, r"bias must have lhs's dtype"),
        ((_t(4, 5), _t(5, 3, device="meta"), None), ValueError, r"rhs must be on lhs's device cpu, got meta"),
        ((_t(4, 5, dtype=torch.int32), _t(5, 3, dtype=torch.int32), None), TypeError, r"lhs must be float32, float16, bfloat16 or float64, got torch.int32"),
        ((_t(4, 5), _t(5, 3), _t(3, dtype=torch.int64)), TypeError, r"bias must be float32.*got torch.int64"),
        ((_t(5), _t(5, 3), None), ValueError, r"lhs must be 2-D \[M, K\] or 3-D \[B, M, K\], got shape \[5\]"),
        ((_t(4, 5), _t(1, 2, 5, 3), None), ValueError, r"rhs must be 2-D \[K, N\] or 3-D \[B, K, N\], got shape \[1, 2, 5, 3\]"),
        ((_t(2, 4, 5), _t(3, 5, 3), None), ValueError, r"batch dims of lhs and rhs must be equal or 1, got 2 \(lhs\) and 3 \(rhs\)"),
        (([[1.0]], _t(1, 1), None), TypeError, r"lhs must be a torch.Tensor, got list"),
    ],
    ids=["k_mismatch", "k_mismatch_batched", "bias_wrong_n", "bias_too_many_dims", "bias_wrong_m", "dtype_rhs",
         "dtype_bias", "device", "integer", "integer_bias", "rank1", "rank4", "batch_mismatch", "not_a_tensor"],
)
def test_bad_input_raises(args, error, match):
    # Loaded and dispatched first: the call below takes the usual path, where the C++ op checks the inputs
    # and the named errors come from the Python checks only once it has refused them.
    fused_matmul_add_relu(_t(2, 3), _t(3, 2), _t(2))
    with pytest.raises(error, match=match):
        fused_matmul_add_relu(*args)
    for grad in (False, True):  # the same where a gradient is needed (the Function's forward refuses them)
        tensors = [a.requires_grad_(grad) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        with pytest.raises(error, match=match):
            fused_matmul_add_relu(*tensors)


# A direct torch.ops call skips the Python checks; the C++ ones must say the same. Run in a fresh
# process, so that a crash in the error path fails this test alone rather than the whole session.
_OP_ERROR_CASES = """
z = lambda *s, dtype=torch.float32: torch.zeros(s, dtype=dtype)
cases = [
    ((z(4, 5), z(6, 3), None), r"rhs must have K=5 rows to match lhs's last dim, got 6"),
    ((z(4, 5), z(5, 3), z(4)), r"bias must broadcast to the output's shape \\[4, 3\\]"),
    ((z(4, 5, dtype=torch.int32), z(5, 3, dtype=torch.int32), None), r"lhs must be float32"),
    ((z(4, 5), z(5, 3, dtype=torch.float64), None), r"rhs must have lhs's dtype"),
    ((z(5), z(5, 3), None), r"lhs must be 2-D"),
    ((z(2, 4, 5), z(3, 5, 3), None), r"batch dims of lhs and rhs must be equal or 1"),
]
"""


def test_bad_input_raises_in_the_op_too():
    code = f"""
import re, torch
from opbuilder.ops.fused_matmul_add_relu import fused_matmul_add_relu_op
op = fused_matmul_add_relu_op()
{_OP_ERROR_CASES}
for i, (args, pattern) in enumerate(cases):
    print(f"case {{i}}: ", end="", flush=True)
    try:
        op(*args)
    except RuntimeError as e:
        print("ok" if re.search(pattern, str(e)) else "wrong message: " + str(e).splitlines()[0], flush=True)
    else:
        print("no error", flush=True)
"""
    result = run_python(code)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    lines = result.stdout.strip().splitlines()
    assert lines == [f"case {i}: ok" for i in range(6)], result.stdout


def test_layer_bad_input():
    layer = FusedLinearReLU(5, 3)
    with pytest.raises(ValueError, match=r"x must have in_features=5 as its last dim, got shape \[2, 4\]"):
        layer(torch.zeros(2, 4))
    with pytest.raises(TypeError, match=r"x must be float32"):
        layer(torch.zeros(2, 5, dtype=torch.int64))


# ---- autograd -----------------------------------------------------------------------------------

GRAD_CASES = [
    ((4, 6), (6, 5), (5,)),
    ((1, 4, 6), (3, 6, 5), (4, 1)),
    ((3, 4, 6), (6, 5), (3, 4, 5)),
    ((4, 6), (2, 6, 5), ()),
    ((2, 4, 6), (2, 6, 5), (2, 1, 5)),
    ((4, 6), (6, 5), None),
]


@pytest.mark.parametrize("shapes", GRAD_CASES, ids=str)
def test_gradcheck_float64(shapes):
    lhs_shape, rhs_shape, bias_shape = shapes
    torch.manual_seed(3)
    lhs = make(lhs_shape, "cpu", torch.float64, requires_grad=True)
    rhs = make(rhs_shape, "cpu", torch.float64, requires_grad=True)
    inputs = [lhs, rhs]
    if bias_shape is not None:
        inputs.append(make(bias_shape, "cpu", torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda *a: fused_matmul_add_relu(*a), inputs)


def test_gradcheck_transposed_rhs():
    torch.manual_seed(4)
    weight = make((5, 6), "cpu", torch.float64, requires_grad=True)
    x = make((4, 6), "cpu", torch.float64, requires_grad=True)
    bias = make((5,), "cpu", torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: fused_matmul_add_relu(x, w.t(), b), [x, weight, bias])


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    return t if t.shape == torch.Size(shape) else t.sum_to_size(shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shapes", GRAD_CASES[:5] + [((7, 111), (111, 33), (33,)), ((300, 64), (64, 520), (520,))],
                         ids=str)
def test_backward_matches_reference(device, dtype, shapes):
    lhs_shape, rhs_shape, bias_shape = shapes
    torch.manual_seed(5)
    lhs = make(lhs_shape, device, dtype, requires_grad=True)
    rhs = make(rhs_shape, device, dtype, requires_grad=True)
    bias = make(bias_shape, device, dtype, requires_grad=True)
    out = fused_matmul_add_relu(lhs, rhs, bias)
    grad = torch.randn_like(out)
    out.backward(grad)
    # The backward given this forward's mask: (grad * (out > 0)) through the two products and the sum.
    gp = grad.double().cpu() * (out.detach().double().cpu() > 0)
    l64, r64 = _f64(lhs), _f64(rhs)

    def check(actual, a, b, shape):
        prod = a @ b
        ref = _sum_to(prod, shape)
        terms = a.shape[-1] * (prod.numel() // max(ref.numel(), 1))
        assert_within(actual, ref, _sum_to(prod.abs(), shape), _sum_to((a * a) @ (b * b), shape).sqrt(), terms, dtype)

    check(lhs.grad, gp, r64.mT, lhs_shape)
    check(rhs.grad, l64.mT, gp, rhs_shape)
    bias_ref = _sum_to(gp, bias_shape)
    terms = gp.numel() // max(bias_ref.numel(), 1)
    assert_within(bias.grad, bias_ref, _sum_to(gp.abs(), bias_shape), _sum_to(gp * gp, bias_shape).sqrt(), terms, dtype)


# ---- relu_bias_backward: the backward's ReLU and bias terms in one pass ------------------------------

# Odd widths (no 16-byte packs), widths of whole packs, one row, many rows to few columns and the reverse
# (on CUDA: one chunk of rows written straight to grad_bias, and many chunks summed by a second kernel).
RELU_BIAS_SHAPES = [(7, 13), (300, 520), (1, 4096), (4097, 8), (3, 1), (2, 20000)]


def _check_relu_bias(grad: torch.Tensor, out: torch.Tensor, grad_pre: torch.Tensor, grad_bias: torch.Tensor) -> None:
    """grad_pre exactly threshold_backward's; grad_bias against the float64 column sum of it."""
    assert grad_pre.dtype == grad_bias.dtype == grad.dtype and grad_pre.device == grad_bias.device == grad.device
    assert grad_pre.shape == grad.shape and grad_bias.shape == grad.shape[1:] and grad_pre.is_contiguous()
    torch.testing.assert_close(grad_pre, torch.ops.aten.threshold_backward(grad, out, 0), rtol=0, atol=0)
    gp = _f64(grad_pre)
    terms = grad.shape[0]
    assert_within(grad_bias, gp.sum(0), gp.abs().sum(0), (gp * gp).sum(0).sqrt(), terms, grad.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", RELU_BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_relu_bias_backward_matches_reference(device, dtype, shape):
    torch.manual_seed(40)
    grad, out = make(shape, device, dtype), make(shape, device, dtype)
    grad_pre, grad_bias = relu_bias_backward_op()(grad, out)
    _check_relu_bias(grad, out, grad_pre, grad_bias)
    again = relu_bias_backward_op()(grad, out)
    assert torch.equal(again[1], grad_bias), "the bias's gradient differs from one run to the next"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_relu_bias_backward_strided_and_unaligned(device, dtype):
    torch.manual_seed(41)
    grad, out = make((520, 300), device, dtype).t(), make((520, 300), device, dtype).t()
    _check_relu_bias(grad, out, *relu_bias_backward_op()(grad, out))
    # Contiguous views one element past an aligned start: the CUDA kernel's element-wise variant, taken when
    # either input is unaligned.
    buf_g, buf_o = make(300 * 520 + 1, device, dtype), make(300 * 520 + 1, device, dtype)
    for g_off, o_off in ((1, 1), (0, 1), (1, 0)):
        grad = buf_g[g_off:g_off + 300 * 520].view(300, 520)
        out = buf_o[o_off:o_off + 300 * 520].view(300, 520)
        _check_relu_bias(grad, out, *relu_bias_backward_op()(grad, out))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_relu_bias_backward_cuda_workspace_fits_either_plan(dtype):
    # At 4224 x 1024 the 16-byte-pack plan cuts the rows into more chunks than the element plan (64 against 33 on
    # 132 SMs): the workspace must hold the larger (the launcher refuses a smaller one).
    torch.manual_seed(43)
    for offset in (0, 1):  # aligned: the pack plan; one element off: the element plan
        buf_g, buf_o = make(4224 * 1024 + 1, "cuda", dtype), make(4224 * 1024 + 1, "cuda", dtype)
        grad, out = buf_g[offset:offset + 4224 * 1024].view(4224, 1024), buf_o[offset:offset + 4224 * 1024].view(4224, 1024)
        _check_relu_bias(grad, out, *relu_bias_backward_op()(grad, out))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)], ids=str)
def test_relu_bias_backward_empty(device, shape):
    grad = torch.randn(shape, device=device)
    grad_pre, grad_bias = relu_bias_backward_op()(grad, torch.randn(shape, device=device))
    assert grad_pre.shape == shape and grad_bias.shape == shape[1:]
    assert torch.equal(grad_bias, torch.zeros(shape[1], device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_relu_bias_backward_nan_and_signed_zero_as_threshold_backward(device):
    out = torch.tensor([[float("nan"), -0.0, 0.0, 1.0, -1.0, float("inf")]] * 3, device=device)
    grad = torch.arange(18, dtype=torch.float32, device=device).view(3, 6) + 1
    grad_pre, grad_bias = relu_bias_backward_op()(grad, out)
    want = torch.ops.aten.threshold_backward(grad, out, 0)
    assert torch.equal(grad_pre, want) and torch.equal(grad_bias, want.sum(0))
    assert grad_pre[:, 0].ne(0).all() and grad_pre[:, 1:3].eq(0).all()


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.randn(6), torch.randn(6)), (RuntimeError, ValueError), "grad must be 2-D"),
        ((torch.randn(2, 3), torch.randn(3, 2)), (RuntimeError, ValueError), r"out must have grad's shape \[2, 3\]"),
        ((torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)), (RuntimeError, TypeError),
         "out must have grad's dtype"),
        ((torch.ones(2, 3, dtype=torch.int32), torch.ones(2, 3, dtype=torch.int32)), (RuntimeError, TypeError),
         "grad must be float32, float16, bfloat16 or float64, got (torch.int32|Int)"),
    ],
    ids=["1-D", "shape", "dtype", "int"],
)
def test_relu_bias_backward_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        relu_bias_backward_op()(*args)
    with pytest.raises(error, match=match):  # the fake (meta) says the same
        relu_bias_backward_op()(*[a.to("meta") for a in args])


@pytest.mark.parametrize("device", DEVICES)
def test_relu_bias_backward_opcheck(device):
    torch.manual_seed(42)
    for shape, dtype in (((7, 13), torch.float32), ((64, 48), torch.bfloat16), ((0, 4), torch.float32)):
        torch.library.opcheck(relu_bias_backward_op(), (make(shape, device, dtype), make(shape, device, dtype)))


def test_no_grad_for_inputs_that_do_not_need_it():
    lhs = torch.randn(4, 6, requires_grad=True)
    rhs, bias = torch.randn(6, 5), torch.randn(5)
    fused_matmul_add_relu(lhs, rhs, bias).sum().backward()
    assert lhs.grad is not None and rhs.grad is None and bias.grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.manual_seed(6)
    op = fused_matmul_add_relu_op()
    f32 = lambda *s, grad=True: make(s, device, torch.float32, grad)  # noqa: E731
    bf16 = lambda *s: make(s, device, torch.bfloat16, True)  # noqa: E731
    samples = [
        (f32(4, 6), f32(6, 5), f32(5)),
        (f32(1, 4, 6), f32(3, 6, 5), f32(4, 1)),
        (f32(3, 4, 6, grad=False), f32(5, 6, grad=False).t(), f32(3, 4, 5, grad=False)),
        (bf16(4, 6), bf16(6, 5), None),
    ]
    for args in samples:
        torch.library.opcheck(op, args)


# ---- torch.compile ------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = FusedLinearReLU(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x, other):
        h = self.fc2(self.fc1(x))  # [B, T, 8]
        return fused_matmul_add_relu(h, other, self.bias)  # [B, T, 8] @ [8, 8]


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_matches_eager(device):
    torch.manual_seed(7)
    model = _Block().to(device)
    x, other = torch.randn(2, 5, 16, device=device), torch.randn(8, 8, device=device)
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True)
    expected = model(x, other)
    expected.square().sum().backward()
    got = compiled(x, other)
    got.square().sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")



def test_torch_compile_rows_known_only_at_run_time():
    # x[mask] under torch.compile has a row count the trace cannot compare (unbacked): the fake's shape check
    # must not ask whether it is 1 (a [1, N] bias), which failed the compile; the op checks the real sizes.
    torch.manual_seed(19)
    x, w, bias = torch.randn(6, 8), torch.randn(8, 5), torch.randn(1, 5)
    fn = lambda x: fused_matmul_add_relu(x[x[:, 0] > 0], w, bias)  # noqa: E731
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, fn(x))

# ---- the layer ----------------------------------------------------------------------------------

def test_layer_initialises_like_linear():
    torch.manual_seed(8)
    linear = nn.Linear(37, 11)
    torch.manual_seed(8)
    fused = FusedLinearReLU(37, 11)
    assert fused.weight.shape == (11, 37) and fused.bias.shape == (11,)
    torch.testing.assert_close(fused.weight, linear.weight, rtol=0, atol=0)
    torch.testing.assert_close(fused.bias, linear.bias, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trip_with_linear(bias):
    fused = FusedLinearReLU(6, 4, bias=bias, dtype=torch.float64)
    assert set(fused.state_dict()) == ({"weight", "bias"} if bias else {"weight"})
    linear = nn.Linear(6, 4, bias=bias, dtype=torch.float64)
    linear.load_state_dict(fused.state_dict())
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(fused(x), torch.relu(linear(x)), rtol=1e-12, atol=1e-12)
    back = FusedLinearReLU(6, 4, bias=bias, dtype=torch.float64)
    nn.init.zeros_(back.weight)
    back.load_state_dict(linear.state_dict())
    torch.testing.assert_close(back(x), torch.relu(linear(x)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_shape", [(6,), (3, 6), (2, 3, 6), (2, 2, 3, 6), (0, 6)], ids=str)
def test_layer_matches_linear_relu(device, x_shape):
    torch.manual_seed(9)
    fused = FusedLinearReLU(6, 4, device=device, dtype=torch.float64)
    linear = nn.Linear(6, 4, device=device, dtype=torch.float64)
    linear.load_state_dict(fused.state_dict())
    x = torch.randn(x_shape, device=device, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = fused(x), torch.relu(linear(x_ref))
    assert y.shape == (*x_shape[:-1], 4)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.weight.grad, linear.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.bias.grad, linear.bias.grad, rtol=1e-12, atol=1e-12)
    assert fused.weight.grad.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bf16_like_linear_relu(device):
    torch.manual_seed(10)
    fused = FusedLinearReLU(64, 48, device=device)
    reference = nn.Sequential(nn.Linear(64, 48, device=device), nn.ReLU())
    reference[0].load_state_dict(fused.state_dict())
    x = torch.randn(2, 5, 64, device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = fused(x)
        y_ref = reference(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    # Both compute from the bf16-rounded inputs: check ours against that float64 reference, and
    # nn.Linear's against the same, so the two behave alike.
    x16, w16, b16 = x.bfloat16().reshape(-1, 64), fused.weight.bfloat16(), fused.bias.bfloat16()
    check_forward(y.reshape(-1, 48), x16, w16.t(), b16)
    check_forward(y_ref.reshape(-1, 48).contiguous(), x16, w16.t(), b16)
    y.float().sum().backward()
    assert fused.weight.grad.dtype == torch.float32 and fused.bias.grad.dtype == torch.float32


# ---- CUDA only ----------------------------------------------------------------------------------

@requires_cuda
def test_cuda_tf32_follows_torch_setting():
    torch.manual_seed(12)
    lhs, rhs = make((64, 1024), "cuda", torch.float32), make((1024, 96), "cuda", torch.float32)
    bias = make((96,), "cuda", torch.float32)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        check_forward(fused_matmul_add_relu(lhs, rhs, bias), lhs, rhs, bias, u_acc=U_TF32)
        torch.backends.cuda.matmul.allow_tf32 = False
        check_forward(fused_matmul_add_relu(lhs, rhs, bias), lhs, rhs, bias)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_large_linear_shape(dtype):
    # A shape that takes cuBLASLt's tensor-core kernels (and maybe split-K), vector and full bias.
    torch.manual_seed(13)
    lhs, w = make((1024, 2048), "cuda", dtype), make((768, 2048), "cuda", dtype)
    for bias in (make((768,), "cuda", dtype), make((1024, 768), "cuda", dtype)):
        check_forward(fused_matmul_add_relu(lhs, w.t(), bias), lhs, w.t(), bias)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_same_problem_with_new_operands_each_call(dtype):
    # The launcher keeps a problem's descriptor and layouts between calls; only the operands' pointers (the
    # bias's among them, set on the kept descriptor) change. Calls of one shape with new tensors each time,
    # with and without a bias between them, must each use their own.
    torch.manual_seed(17)
    for bias_shape in [(96,), None, (96,), (64, 96), (96,)]:
        lhs, rhs = make((64, 256), "cuda", dtype), make((256, 96), "cuda", dtype)
        bias = None if bias_shape is None else make(bias_shape, "cuda", dtype) * 4
        check_forward(fused_matmul_add_relu(lhs, rhs, bias), lhs, rhs, bias)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_call_takes_only_the_workspace_its_algorithm_needs(dtype):
    # The launcher took a 32 MiB workspace from the caching allocator on every call, whatever the algorithm
    # needed: one more dispatcher call a call, and 32 MiB more peak memory. A small problem needs little or none.
    torch.manual_seed(18)
    lhs, rhs, bias = make((16, 32), "cuda", dtype), make((32, 24), "cuda", dtype), make((24,), "cuda", dtype)
    fused_matmul_add_relu(lhs, rhs, bias)  # the build, the handle and the algorithm's choice
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fused_matmul_add_relu(lhs, rhs, bias)
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - before
    assert grew < 32 << 20, f"one call of a 16 x 32 x 24 problem raised the peak by {grew} bytes"
    check_forward(out, lhs, rhs, bias)


@requires_cuda
def test_cuda_threads_calling_one_problem_at_once():
    # Each thread's calls must see their own bias while other threads run the same problem: the kept
    # descriptor (which holds the bias pointer) is per thread. The calls go back to back, unsynchronised (the
    # op releases the GIL), so that two threads are often inside the launcher at once; checked afterwards.
    import threading

    errors: list[BaseException] = []
    results: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        try:
            gen = torch.Generator(device="cuda").manual_seed(100 + i)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                args = [(torch.randn(48, 128, device="cuda", generator=gen),
                         torch.randn(128, 80, device="cuda", generator=gen),
                         torch.randn(80, device="cuda", generator=gen) * 4) for _ in range(300)]
                barrier.wait()
                for lhs, rhs, bias in args:
                    results[i].append((fused_matmul_add_relu(lhs, rhs, bias), lhs, rhs, bias))
            stream.synchronize()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    wrong = 0
    for per_thread in results:
        assert len(per_thread) == 300
        for out, lhs, rhs, bias in per_thread:
            ref = (_f64(lhs) @ _f64(rhs) + _f64(bias)).relu()
            wrong += not torch.allclose(out.double().cpu(), ref, rtol=1e-2, atol=1e-2)  # TF32 or not
    assert wrong == 0, f"{wrong} of 1200 calls used another call's operands"


@requires_cuda
def test_cuda_graph_capture_forward_backward():
    torch.manual_seed(14)
    model = FusedLinearReLU(64, 128, device="cuda")
    eager = copy.deepcopy(model)
    static_x = torch.randn(32, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up: builds, creates the handle, picks algorithms
            model.zero_grad(set_to_none=True)
            model(static_x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
        static_y.square().sum().backward()
    for seed in (15, 16):
        torch.manual_seed(seed)
        x = torch.randn(32, 64, device="cuda")
        static_x.copy_(x)
        graph.replay()
        eager.zero_grad(set_to_none=True)
        y = eager(x)
        y.square().sum().backward()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_y, y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.weight.grad, eager.weight.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.bias.grad, eager.bias.grad, rtol=1e-4, atol=1e-4)
