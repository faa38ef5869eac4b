"""relu against torch.relu on every dtype, odd sizes, non-contiguous and empty inputs; opcheck,
gradcheck and torch.compile; the training path's sign mask (its layout, its backward, that it is all the
step saves)."""

from __future__ import annotations

import pytest
import torch

import opbuilder.ops as ops
from helpers import DEVICES, requires_cuda
from opbuilder.ops.relu import mask_words, relu_mask_backward_op, relu_mask_op, relu_op
from torch.utils._python_dispatch import TorchDispatchMode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 4097, 1 << 20]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch(device: str, dtype: torch.dtype, n: int) -> None:
    x = (torch.randn(n, device=device) * 3).to(dtype)
    torch.testing.assert_close(ops.relu(x), torch.relu(x), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_special_values(device: str) -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -1e-40, 1e-40], device=device)
    torch.testing.assert_close(ops.relu(x), torch.relu(x), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_and_offset(device: str, dtype: torch.dtype) -> None:
    base = torch.randn(64, 130, device=device).to(dtype)
    for x in (base.t(), base[:, 1:], base[::3, ::2], base.view(-1)[3:]):
        torch.testing.assert_close(ops.relu(x), torch.relu(x), rtol=0, atol=0)


def test_layer_and_shape() -> None:
    x = torch.randn(2, 3, 5)
    y = ops.ReLU()(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, torch.relu(x))


def test_gradcheck() -> None:
    x = torch.randn(37, dtype=torch.float64, requires_grad=True)
    x = (x + torch.sign(x) * 0.1).detach().requires_grad_()  # stay away from the kink at 0
    assert torch.autograd.gradcheck(ops.relu, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    for x in (torch.randn(33, device=device, requires_grad=True), torch.randn(4, 5, device=device).t()):
        torch.library.opcheck(relu_op(), (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device: str) -> None:
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), ops.ReLU(), torch.nn.Linear(8, 4)).to(device)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(5, 8, device=device, requires_grad=True)
    expected = model(x)
    expected.sum().backward()
    expected_grad, x.grad = x.grad, None
    got = compiled(x)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    torch.testing.assert_close(x.grad, expected_grad)


@pytest.mark.parametrize("bad, exc, words", [
    (torch.arange(4), TypeError, "relu: x must be float32, float16, bfloat16 or float64, got torch.int64"),
    ([1.0, 2.0], TypeError, "relu: x must be a torch.Tensor, got list"),
])
def test_bad_input(bad: object, exc: type, words: str) -> None:
    with pytest.raises(exc, match=words.replace("(", r"\(")):
        ops.relu(bad)


@pytest.mark.parametrize("device", DEVICES)
def test_the_cxx_check_also_names_the_argument(device: str) -> None:
    with pytest.raises(RuntimeError, match="relu: x must be float32"):
        relu_op()(torch.arange(4, device=device))


def test_namespace_carries_the_key() -> None:
    from opbuilder import get_builder

    builder = get_builder("relu")
    assert builder.namespace == f"opb_relu_{builder.key[:12]}"
    assert relu_op().name().startswith(builder.namespace + "::")


@requires_cuda
def test_cuda_graph_capture_and_replay() -> None:
    x = torch.randn(1 << 16, device="cuda")
    ops.relu(x)  # load outside capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = ops.relu(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, torch.relu(x), rtol=0, atol=0)


# ---- the training path: relu_mask and its backward -------------------------------------------------

MASK_DTYPES = DTYPES + [torch.float64]
MASK_SIZES = [0, 1, 7, 129, 4097, (1 << 16) + 3]


def mask_reference(x: torch.Tensor) -> torch.Tensor:
    """kernels/relu/relu_mask.h's layout, built with torch: tiles of 32 x P elements (P = 16 / element size),
    element o of a tile at bit o // P of the tile's word o % P. Returns the words as int64 in [0, 2^32)."""
    per = 16 // x.element_size()
    flat = x.reshape(-1)
    tiles = -(-flat.numel() // (32 * per))
    pos = torch.zeros(tiles * 32 * per, dtype=torch.int64, device=x.device)
    pos[: flat.numel()] = (~(flat <= 0)).to(torch.int64)  # 1 for NaN too
    bits = pos.view(tiles, 32, per).transpose(1, 2)  # [tile, word k, bit L] = element L * P + k
    return (bits << torch.arange(32, device=x.device)).sum(-1).reshape(-1)


def with_specials(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    x = torch.randn(n, device=device) * 3
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-30, -1e-30], device=device)
    x[: min(n, 7)] = specials[: min(n, 7)]
    if n > 64:
        x[n // 2 :: 31] = 0.0  # zeros well inside, where the mask's bits are packed
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MASK_DTYPES)
@pytest.mark.parametrize("n", MASK_SIZES)
def test_mask_forward_and_layout(device: str, dtype: torch.dtype, n: int) -> None:
    x = with_specials(n, dtype, device)
    y, mask = relu_mask_op()(x)
    torch.testing.assert_close(y, torch.relu(x), rtol=0, atol=0, equal_nan=True)
    assert mask.dtype == torch.int32 and mask.shape == (mask_words(n, dtype),)
    assert torch.equal(mask.to(torch.int64) & 0xFFFFFFFF, mask_reference(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MASK_DTYPES)
@pytest.mark.parametrize("n", MASK_SIZES)
def test_mask_backward_equals_torch(device: str, dtype: torch.dtype, n: int) -> None:
    x = with_specials(n, dtype, device)
    y, mask = relu_mask_op()(x)
    grad = torch.randn(n, device=device).to(dtype)
    grad[::5] = float("nan")  # dropped where y <= 0, kept elsewhere (a NaN y too), as torch does
    expected = torch.ops.aten.threshold_backward(grad, torch.relu(x), 0)
    torch.testing.assert_close(relu_mask_backward_op()(grad, mask), expected, rtol=0, atol=0, equal_nan=True)


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def every_bit_pattern(dtype: torch.dtype, device: str) -> torch.Tensor:
    """Every value of a 16-bit dtype (NaNs of each payload and sign, subnormals, +-0, +-inf), then 100 more: whole
    tiles of the mask and a partial one. For float32 and float64, 2**16 + 100 random bit patterns and the specials."""
    ints = _BITS[dtype]
    if dtype.itemsize == 2:
        bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(ints)
    else:
        info = torch.iinfo(ints)
        bits = torch.randint(info.min, info.max, (1 << 16,), dtype=ints, generator=torch.Generator().manual_seed(0))
        specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-310, -1e-310,
                                 1e-40, -1e-40], dtype=torch.float64).to(dtype).view(ints)
        bits = torch.cat([specials, bits])
    return torch.cat([bits, bits[:100]]).to(device).view(dtype)


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal bit for bit (-0.0 is not +0.0) where expected is a number; a NaN where it is NaN (torch computes a
    16-bit relu in float32, which quiets a signalling NaN)."""
    ints = _BITS[got.dtype]
    nan = expected.isnan()
    return bool(torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(ints), expected[~nan].view(ints)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MASK_DTYPES)
def test_every_bit_pattern(device: str, dtype: torch.dtype) -> None:
    # Bit for bit: assert_close takes -0.0 for +0.0, which a kernel deciding on the bits could swap.
    x = every_bit_pattern(dtype, device)
    # torch's CPU relu keeps -0.0 (x < 0 ? 0 : x), its CUDA relu gives +0.0; ours keeps it on both devices.
    expected = torch.relu(x.cpu()).to(device)
    assert same_bits(relu_op()(x), expected)
    assert same_bits(ops.relu(x), expected)  # relu.nograd
    y, mask = relu_mask_op()(x)
    assert same_bits(y, expected)
    assert torch.equal(mask.to(torch.int64) & 0xFFFFFFFF, mask_reference(x))
    grad = every_bit_pattern(dtype, device).flip(0)  # every pattern again, NaNs too, against another x
    got = relu_mask_backward_op()(grad, mask)
    assert same_bits(got, torch.ops.aten.threshold_backward(grad.cpu(), expected.cpu(), 0).to(device))
    assert torch.equal(got[expected <= 0].view(_BITS[dtype]), torch.zeros_like(got[expected <= 0].view(_BITS[dtype])))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_training_step_non_contiguous(device: str, dtype: torch.dtype) -> None:
    base = torch.randn(64, 130, device=device).to(dtype)
    for view in (base.t(), base[:, 1:], base[::3, ::2], base.view(-1)[3:]):
        x = view.detach().requires_grad_()
        ref = view.detach().requires_grad_()
        grad = torch.randn(view.shape, device=device).to(dtype).t().contiguous().t()  # a non-contiguous grad too
        ops.relu(x).backward(grad)
        torch.relu(ref).backward(grad)
        torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)


class Calls(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name().split("::")[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_the_training_path_saves_only_the_mask(device: str) -> None:
    x = torch.randn(1000, device=device, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), Calls() as calls:
        y = ops.relu(x)
        y.backward(torch.ones_like(y))
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.int32, mask_words(1000, torch.float32))]
    # (relu_mask's overload without autograd, inside the eager path's Function: opbuilder.torchop.eager)
    assert "relu_mask.nograd" in calls.names and "relu_mask_backward" in calls.names and "relu" not in calls.names
    assert "threshold_backward" not in calls.names
    # Without a gradient to compute, no mask is written: relu's overload without autograd (opbuilder.torchop.eager).
    for no_grad_input in (x.detach(), x):
        with torch.no_grad(), Calls() as calls:
            ops.relu(no_grad_input)
        assert calls.names == ["relu.nograd"]


def test_mask_gradcheck_and_gradgradcheck() -> None:
    x = torch.randn(300, dtype=torch.float64)
    x = (x + torch.sign(x) * 0.1).requires_grad_()  # stay away from the kink at 0
    assert torch.autograd.gradcheck(ops.relu, (x,))
    assert torch.autograd.gradgradcheck(ops.relu, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_mask_opcheck(device: str) -> None:
    for x in (torch.randn(300, device=device, requires_grad=True), torch.randn(40, 5, device=device).t()):
        torch.library.opcheck(relu_mask_op(), (x,))
        _, mask = relu_mask_op()(x.detach())
        torch.library.opcheck(relu_mask_backward_op(), (torch.randn(x.shape, device=device), mask))


@pytest.mark.parametrize("device", DEVICES)
def test_mask_backward_with_an_unaligned_mask(device: str) -> None:
    x = torch.randn(1000, device=device)
    grad = torch.randn(1000, device=device)
    _, mask = relu_mask_op()(x)
    shifted = torch.empty(mask.numel() + 1, dtype=mask.dtype, device=device)
    shifted[1:] = mask  # 4 bytes off the 16-byte alignment the GPU's loads need
    torch.testing.assert_close(relu_mask_backward_op()(grad, shifted[1:]), relu_mask_backward_op()(grad, mask),
                               rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_mask_backward_bad_input(device: str) -> None:
    grad = torch.randn(100, device=device)
    _, mask = relu_mask_op()(torch.randn(100, device=device))
    with pytest.raises(RuntimeError, match=r"relu_mask_backward: mask must be int32 \(from relu_mask\), got Long"):
        relu_mask_backward_op()(grad, mask.long())
    with pytest.raises(RuntimeError, match=r"relu_mask_backward: mask must have shape \[4\] for 100 Float elements, "
                                           r"got \[8\]"):
        relu_mask_backward_op()(grad, torch.cat([mask, mask]))
    with pytest.raises(RuntimeError, match="relu_mask_backward: grad_y must be float32"):
        relu_mask_backward_op()(torch.arange(100, device=device), mask)
