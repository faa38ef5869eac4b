"""softmax: values and gradients against a float64 reference on odd, long, empty and non-contiguous
shapes; -inf, NaN and large inputs; other dims and 0-d; bad input; opcheck, gradcheck, torch.compile,
autocast, the layer; and on the GPU every launch path (forced through the tuning ops) and CUDA-graph
capture."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, requires_cuda, run_python
from helpers.reference import TOLERANCES

from opbuilder.ops.softmax import Softmax, backward_op, forward_op, namespace, softmax

INF = float("inf")
NAN = float("nan")

# The row lengths (1 .. 262144, one row for the longest) and row counts; 32768 adds the
# cluster path (fp32) on the GPU and the longest rows of the CPU's cached path.
SHAPES = [
    (1, 1),
    (3, 7),
    (1000, 111),
    (3, 4095),
    (3, 4096),
    (3, 4097),
    (3, 32768),
    (1, 65536),
    (1, 262144),
]


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x.double().cpu(), dim)


def _subnormal_step(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def _assert_grad_close(actual: torch.Tensor, y: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> None:
    """grad_x against y * (g - sum(g * y)) in float64 for the same (rounded) y. The error allowed for
    an element scales with y_i * (|g_i| + sum(|g * y|)): the size of the terms that cancel in it."""
    assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == y.shape, f"shape {tuple(actual.shape)}, expected {tuple(y.shape)}"
    y64, g64, a64 = y.double().cpu(), g.double().cpu(), actual.double().cpu()
    expected = y64 * (g64 - (g64 * y64).sum(-1, keepdim=True))
    bound = y64.abs() * (g64.abs() + (g64 * y64).abs().sum(-1, keepdim=True))
    rtol, atol = TOLERANCES[dtype]
    nan = torch.isnan(expected)
    bound = bound + _subnormal_step(dtype) / atol  # results below the normal range round in fixed steps
    assert torch.equal(torch.isnan(a64), nan), "NaN positions differ"
    excess = ((a64 - expected).abs() - atol * bound - rtol * expected.abs()).masked_fill(nan, 0)
    if expected.numel() and excess.max() > 0:
        i = int(excess.argmax())
        raise AssertionError(f"grad_x off by {(a64 - expected).abs().flatten()[i]:.3g} at flat index {i}: "
                             f"{a64.flatten()[i]:.6g} vs {expected.flatten()[i]:.6g} (bound {bound.flatten()[i]:.3g})")


def _assert_close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, cols: int) -> None:
    """Probabilities compared after scaling by the row length, so a uniform row is 1 and atol means
    something for long rows too (1/262144 is far below float32's atol)."""
    assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected64.shape, f"shape {tuple(actual.shape)}, expected {tuple(expected64.shape)}"
    rtol, atol = TOLERANCES[dtype]
    scale = max(cols, 1)
    atol += _subnormal_step(dtype) * scale  # float16 probabilities of long rows are subnormal
    torch.testing.assert_close(actual.double().cpu() * scale, expected64.double().cpu() * scale, rtol=rtol, atol=atol,
                               equal_nan=True)


def _input(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 4).to(dtype).to(device)


# ---- values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_reference(device: str, shape: tuple[int, int]) -> None:
    for dtype in DTYPES:
        x = _input(shape, dtype, device)
        y = forward_op()(x)
        _assert_close(y, _reference(x), dtype, shape[-1])
        g = _input(shape, dtype, device, seed=1)
        grad_x = backward_op()(y, g)
        _assert_grad_close(grad_x, y, g, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_flatten_to_rows(device: str) -> None:
    x = _input((2, 3, 5, 111), torch.float32, device)
    _assert_close(softmax(x), _reference(x), torch.float32, 111)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [7, 4097, 70000])
def test_inf_and_nan_rows_match_torch(device: str, cols: int) -> None:
    """-inf entries give 0; a row of only -inf, or holding NaN or +inf, gives NaN everywhere (torch's
    answer). cols 70000 crosses the CPU's online path (chunks of 2048) and the GPU's split path."""
    rows = torch.randn(8, cols) * 3
    rows[0, ::3] = -INF  # some -inf
    rows[1, :] = -INF  # all -inf
    rows[2, cols // 2] = NAN
    rows[3, -1] = INF
    rows[4, : cols - 1] = -INF  # one finite entry, last
    rows[5, : (cols + 1) // 2] = -INF  # a first half of -inf (whole chunks, whole blocks)
    rows[6] = torch.linspace(-50, 50, cols)  # the max comes last: every chunk rescales the sum
    rows[7, 0] = NAN  # NaN among -inf, finite values after (whole -inf chunks on the CPU's online path)
    rows[7, 1:3000] = -INF
    for dtype in DTYPES:
        x = rows.to(dtype).to(device)
        expected = torch.softmax(x.double().cpu(), -1)
        assert torch.isnan(expected[1]).all() and torch.isnan(expected[2]).all() and torch.isnan(expected[3]).all()
        y = softmax(x)
        assert torch.equal(torch.isnan(y.cpu()), torch.isnan(expected)), f"NaN rows differ ({dtype})"
        _assert_close(y, expected, dtype, cols)
        assert (y[0].cpu()[::3] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_large_magnitudes(device: str, dtype: torch.dtype) -> None:
    """No overflow: exp only ever sees x - max <= 0."""
    big = torch.finfo(dtype).max
    x = torch.randn(6, 4096) * 1e4
    x[1] = big
    x[2, :10] = big
    x[3] = -big
    x[4, ::2] = -big
    x[5] = torch.linspace(-big, big, 4096)
    x = x.to(dtype).to(device)
    _assert_close(softmax(x), _reference(x), dtype, 4096)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_sum_to_one(device: str) -> None:
    x = _input((64, 4097), torch.bfloat16, device)
    sums = softmax(x).double().sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=4097 * 2**-9)
    x = _input((4, 65536), torch.float32, device)
    sums = softmax(x).double().sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-5)


# ---- shapes and layouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,dim", [((0, 5), -1), ((5, 0), -1), ((5, 0), 0), ((2, 0, 3), 1), ((0,), 0)])
def test_empty(device: str, shape: tuple[int, ...], dim: int) -> None:
    x = torch.empty(shape, device=device).requires_grad_()
    y = softmax(x, dim)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous(device: str, dtype: torch.dtype) -> None:
    base = _input((300, 514), dtype, device)
    for x in (base.t(), base[:, 1::2], base[::3, 2:], base.unsqueeze(0).expand(2, -1, -1)):
        assert not x.is_contiguous()
        _assert_close(softmax(x), _reference(x), dtype, x.shape[-1])


@pytest.mark.parametrize("device", DEVICES)
def test_misaligned_rows(device: str) -> None:
    """A view starting one element in: the GPU cannot use 16-byte vectors and takes the scalar loads."""
    base = _input((1, 64 * 4096 + 1), torch.float32, device)
    x = base[0, 1:].view(64, 4096)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    _assert_close(softmax(x), _reference(x), torch.float32, 4096)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [0, 1, -2, 2, -1])
def test_other_dims_match_torch(device: str, dim: int) -> None:
    x = _input((6, 37, 9), torch.float32, device).requires_grad_()
    y = softmax(x, dim)
    _assert_close(y.detach(), _reference(x.detach(), dim), torch.float32, x.shape[dim])
    g = _input(tuple(x.shape), torch.float32, device, seed=2)
    y.backward(g)
    _assert_grad_close(x.grad.movedim(dim, -1), y.detach().movedim(dim, -1), g.movedim(dim, -1), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_dim_like_torch(device: str) -> None:
    for value in (3.0, -INF, INF, NAN):
        x = torch.tensor(value, device=device)
        for dim in (0, -1):
            torch.testing.assert_close(softmax(x, dim), torch.softmax(x, dim), equal_nan=True)
    x = torch.tensor(2.0, device=device, requires_grad=True)
    softmax(x).backward()
    assert x.grad is not None and x.grad.item() == 0.0
    with pytest.raises(ValueError, match=r"dim must be in \[-1, 0\].*got 1"):
        softmax(torch.tensor(1.0, device=device), 1)


# ---- bad input ---------------------------------------------------------------------------------------


def test_bad_input_names_argument_expected_and_got() -> None:
    with pytest.raises(TypeError, match="softmax: x must be float32, float16, bfloat16 or float64, got torch.int64"):
        softmax(torch.arange(6).view(2, 3))
    with pytest.raises(TypeError, match="softmax: x must be a torch.Tensor, got list"):
        softmax([1.0, 2.0])
    with pytest.raises(ValueError, match=r"softmax: dim must be in \[-2, 1\] for x of shape \(2, 3\), got 2"):
        softmax(torch.ones(2, 3), 2)
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 1\].*got -3"):
        softmax(torch.ones(2, 3), -3)
    with pytest.raises(TypeError, match="softmax: dim must be an int, got str"):
        softmax(torch.ones(2, 3), "1")
    with pytest.raises(TypeError, match="softmax: dim must be an int, got bool"):
        softmax(torch.ones(2, 3), True)
    with pytest.raises(TypeError, match="softmax: dim must be an int, got NoneType"):
        Softmax(dim=None)(torch.ones(2, 3))


_OP_ERROR_CASES = r"""
import re, torch
from opbuilder.ops.softmax import backward_op, forward_op
y = torch.softmax(torch.randn(4, 8), -1)
cases = [
    (lambda: forward_op()(torch.ones(4, 8, dtype=torch.int32)),
     "softmax.forward: x must be float32, float16, bfloat16 or float64, got Int"),
    (lambda: forward_op()(torch.tensor(1.0)), "softmax.forward: x must have at least 1 dim"),
    (lambda: backward_op()(y, torch.randn(4, 8, dtype=torch.float64)),
     "softmax.backward: grad_y must have y's dtype Float, got Double"),
    (lambda: backward_op()(y, torch.randn(4, 7)),
     r"softmax.backward: grad_y must have y's shape \[4, 8\], got \[4, 7\]"),
]
for call, pattern in cases:
    try:
        call()
    except RuntimeError as err:
        assert re.search(pattern, str(err)), (pattern, str(err))
    else:
        raise AssertionError(f"no error for {pattern}")
print("ok")
"""


def test_op_checks_in_cpp() -> None:
    """A direct torch.ops call skips the Python checks; the C++ ones say the same. In a fresh process:
    a crash in an error path (seen once on the GPU machine) then fails this test alone."""
    result = run_python(_OP_ERROR_CASES)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# ---- autograd, opcheck, compile, autocast -----------------------------------------------------------


@pytest.mark.parametrize("dim", [-1, 0])
def test_gradcheck_float64(dim: int) -> None:
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: softmax(t, dim), (x,))
    assert torch.autograd.gradgradcheck(lambda t: softmax(t, dim), (x,))


def test_gradcheck_backward_op_float64() -> None:
    y = torch.softmax(torch.randn(3, 5, dtype=torch.float64), -1).requires_grad_()
    g = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(backward_op(), (y, g))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    for dtype, shape in ((torch.float32, (5, 33)), (torch.bfloat16, (2, 3, 16)), (torch.float64, (4, 7))):
        x = _input(shape, dtype, device).requires_grad_()
        torch.library.opcheck(forward_op(), (x,))
        y = torch.softmax(x.detach(), -1).requires_grad_()
        g = _input(shape, dtype, device, seed=3).requires_grad_()
        torch.library.opcheck(backward_op(), (y, g))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_matches_eager(device: str) -> None:
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), Softmax(dim=1), torch.nn.Linear(40, 8), Softmax(-1)).to(device)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(16, 24, device=device, requires_grad=True)
    y_eager = model(x)
    (g_eager,) = torch.autograd.grad(y_eager.square().sum(), x)
    y = compiled(x)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    torch.testing.assert_close(y, y_eager)
    torch.testing.assert_close(g, g_eager)
    torch.testing.assert_close(y_eager, torch.softmax(torch.softmax(x @ model[0].weight.t() + model[0].bias, 1)
                                                      @ model[2].weight.t() + model[2].bias, -1))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_like_torch(device: str) -> None:
    """torch.softmax keeps the dtype under CPU autocast and runs in float32 under CUDA autocast."""
    for dtype in (torch.float32, torch.bfloat16):
        x = _input((8, 100), dtype, device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            h = x * 2
            ours = softmax(h, -1)
            ref = torch.softmax(h, -1)
            layer = Softmax(-1)(h)
            torch_layer = torch.nn.Softmax(-1)(h)
        assert ours.dtype == ref.dtype == layer.dtype == torch_layer.dtype
        _assert_close(ours.detach(), ref.detach().double(), ref.dtype, 100)
        (g,) = torch.autograd.grad((ours * torch.arange(100, device=device)).sum(), x, retain_graph=True)
        (g_ref,) = torch.autograd.grad((ref * torch.arange(100, device=device)).sum(), x)
        assert g.dtype == g_ref.dtype == dtype
        rtol, atol = TOLERANCES[ref.dtype]
        torch.testing.assert_close(g.double(), g_ref.double(), rtol=rtol, atol=atol * 10)


def test_layer() -> None:
    layer = Softmax(dim=0)
    assert repr(layer) == "Softmax(dim=0)"
    assert Softmax().dim == -1
    x = torch.randn(5, 3)
    torch.testing.assert_close(layer(x), torch.nn.Softmax(dim=0)(x))


# ---- GPU: every launch path, CUDA graphs ------------------------------------------------------------


def _plans(cols: int, dtype: torch.dtype, vectorized: bool) -> list[list[int]]:
    """Plans [path, threads, vpt, cluster] that cover a row: every warp shape, block shapes for each
    vpt (the smallest cluster that covers the row), blocks of more than 256 threads (forward: vpt 8,
    backward: vpt 4 or 1), and the split path."""
    per = 128 // torch.finfo(dtype).bits if vectorized else 1
    vectors = cols // per
    plans = []
    if dtype != torch.float64:
        plans += [[0, g, v, 1] for g in (1, 2, 4, 8, 16, 32) for v in (1, 2, 4) if g * v >= vectors]
    for v in (1, 2, 4, 8):
        for t in (32, 64, 96, 128, 256):
            cluster = next((c for c in range(1, 9) if t * v * c >= vectors), None)
            if cluster is not None:
                plans.append([1, t, v, cluster])
    for v in (8, 4, 1):
        threads = max(512, 32 * -(-vectors // (32 * v)))
        if threads <= 1024:
            plans.append([1, threads, v, 1])
    plans += [[2, t, 4, 1] for t in (32, 128, 256)]
    return plans


def _cuda_plan_cases() -> list[tuple[int, torch.dtype]]:
    return [(7, torch.float32), (64, torch.bfloat16), (1000, torch.float32), (1000, torch.float16),
            (4097, torch.float32), (4096, torch.bfloat16), (8192, torch.float32), (600, torch.float64)]


@requires_cuda
@pytest.mark.parametrize("cols,dtype", _cuda_plan_cases(), ids=lambda v: str(v).removeprefix("torch."))
def test_every_cuda_path(cols: int, dtype: torch.dtype) -> None:
    ns = namespace()
    x = _input((37, cols), dtype, "cuda")
    x[0, : cols // 2] = -INF
    x[1] = -INF
    expected = _reference(x)
    g = _input((37, cols), dtype, "cuda", seed=4)
    vectorized = cols % (128 // torch.finfo(dtype).bits) == 0
    clusters = torch.cuda.get_device_capability()[0] >= 9
    ran = 0
    for plan in _plans(cols, dtype, vectorized):
        if plan[3] > 1 and not clusters:
            continue
        fwd_ok = not (plan[0] == 1 and plan[1] > 256 and plan[2] != 8)
        bwd_ok = not (plan[0] == 1 and plan[1] > 256 and plan[2] not in (1, 4))
        if fwd_ok:
            y = ns.forward_with_plan(x, plan)
            torch.cuda.synchronize()
            try:
                _assert_close(y, expected, dtype, cols)
            except AssertionError as err:
                raise AssertionError(f"forward plan {plan}: {err}") from None
            ran += 1
        if bwd_ok:
            y = torch.softmax(x.double(), -1).to(dtype)
            gx = ns.backward_with_plan(y, g, plan)
            try:
                _assert_grad_close(gx, y, g, dtype)
            except AssertionError as err:
                raise AssertionError(f"backward plan {plan}: {err}") from None
            ran += 1
    assert ran >= 10
    with pytest.raises(RuntimeError, match="plan cannot run"):
        ns.forward_with_plan(x, [0, 1, 1, 1] if cols > 16 else [1, 32, 1, 9])


@requires_cuda
def test_default_plans_cover_every_path() -> None:
    ns = namespace()
    cases = {
        "warp": ((8, 256), torch.float32),
        "block": ((8, 4096), torch.bfloat16),
        "block 1024 threads": ((4, 32768), torch.float32),
        "cluster": ((400, 65536), torch.float32),
        "split": ((1, 262144), torch.float32),
    }
    plans = {name: ns.default_plan(torch.empty(shape, dtype=dtype, device="cuda"), False)
             for name, (shape, dtype) in cases.items()}
    assert plans["warp"][0] == 0
    assert plans["block"][0] == 1 and plans["block"][3] == 1
    assert plans["block 1024 threads"] == [1, 1024, 8, 1]
    # The backward of the "block" rows (512 vectors) takes one vector a thread over 512 threads.
    assert list(ns.default_plan(torch.empty(8, 4096, dtype=torch.bfloat16, device="cuda"), True)) == [1, 512, 1, 1]
    assert plans["split"][0] == 2
    if torch.cuda.get_device_capability()[0] >= 9:
        assert plans["cluster"][0] == 1 and plans["cluster"][3] == 2
    for name, (shape, dtype) in cases.items():  # each plan runs and is right, forward and backward
        x = _input(shape, dtype, "cuda")
        _assert_close(softmax(x), _reference(x), dtype, shape[-1])
        y = softmax(x)
        g = _input(shape, dtype, "cuda", seed=8)
        _assert_grad_close(backward_op()(y, g), y, g, dtype)


@requires_cuda
@pytest.mark.parametrize("shape", [(64, 4096), (2, 262144), (300, 100)])
def test_cuda_graph_capture_and_replay(shape: tuple[int, int]) -> None:
    static_x = torch.randn(shape, device="cuda", requires_grad=True)
    static_g = torch.randn(shape, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (builds, loads) off the capture
        for _ in range(2):
            y = softmax(static_x)
            torch.autograd.grad(y, static_x, static_g)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = softmax(static_x)
        (static_grad,) = torch.autograd.grad(static_y, static_x, static_g)
    for seed in (5, 6):
        with torch.no_grad():
            static_x.copy_(_input(shape, torch.float32, "cuda", seed=seed))
            static_g.copy_(_input(shape, torch.float32, "cuda", seed=seed + 10))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(static_y.detach(), _reference(static_x.detach()), torch.float32, shape[-1])
        _assert_grad_close(static_grad, static_y.detach(), static_g, torch.float32)


@requires_cuda
@pytest.mark.parametrize("shape,split", [((8, 256), False), ((8, 4096), False), ((1, 262144), True)],
                         ids=["warp", "block", "split"])
def test_cuda_call_allocates_a_workspace_only_for_the_split_path(shape: tuple[int, int], split: bool) -> None:
    # Each allocation through the stable ABI's C shim is a dispatcher call (host time on every call): the output,
    # and the split path's partial results; no empty workspace for the others.
    from torch.profiler import ProfilerActivity, profile

    x = _input(shape, torch.float32, "cuda")
    g = _input(shape, torch.float32, "cuda", seed=3)
    y = forward_op()(x)
    backward_op()(y, g)
    for call in (lambda: forward_op()(x), lambda: backward_op()(y, g)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        made = [e.name for e in prof.events() if e.name in ("aten::empty_strided", "aten::empty")]
        assert len(made) == (2 if split else 1), made
