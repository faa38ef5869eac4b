"""relu against torch.relu on every dtype, odd sizes, non-contiguous and empty inputs; opcheck,
gradcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch

import opbuilder.ops as ops
from conftest import DEVICES, requires_cuda
from opbuilder.ops.relu import relu_op

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
    got = compiled(x)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    assert x.grad is not None


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
