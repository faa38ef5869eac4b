"""Every layer together: a transformer-style block trains like its PyTorch twin, and compiles whole."""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICES
from opbuilder.tools.demo import train, twin_models


@pytest.mark.parametrize("device", DEVICES)
def test_block_trains_like_the_pytorch_block(device: str) -> None:
    fused, plain = twin_models(device, dim=64)
    gen = torch.Generator().manual_seed(3)
    # One batch seen six times: the loss must fall as the block fits it.
    batch = (torch.randn(4, 16, 64, generator=gen).to(device), torch.randn(4, 16, 64, generator=gen).to(device))
    batches = [batch] * 6
    ours, _ = train(fused, batches)
    theirs, _ = train(plain, batches)
    assert ours[-1] < ours[0], "the loss should fall"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_whole_model_compiles_without_graph_breaks(device: str) -> None:
    torch._dynamo.reset()
    fused, _ = twin_models(device, dim=32)
    x = torch.randn(2, 8, 32, device=device, requires_grad=True)
    expected = fused(x)
    compiled = torch.compile(fused, fullgraph=True)
    got = compiled(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    got.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_model_under_autocast_matches_pytorch(device: str) -> None:
    fused, plain = twin_models(device, dim=32)
    x = torch.randn(2, 8, 32, device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        ours, theirs = fused(x), plain(x)
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=5e-2, atol=5e-2)
