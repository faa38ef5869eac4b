"""``./run demo``: a small transformer-style model built from opbuilder's layers, trained beside the
same model built from plain PyTorch modules, with the loss and the time per step of each.

The ops are compiled on first use (the first run shows it), then loaded from the cache.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm attention + ReLU MLP. ``fused=True`` uses opbuilder's layers, ``False`` PyTorch's;
    both have the same parameters under the same names, so one state_dict fits both."""

    def __init__(self, dim: int, heads: int, hidden: int, fused: bool) -> None:
        super().__init__()
        import opbuilder.ops as ops

        self.fused, self.heads = fused, heads
        self.norm1 = ops.RMSNorm(dim) if fused else nn.RMSNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = ops.FusedAddRMSNorm(dim) if fused else nn.RMSNorm(dim, eps=1e-6)
        self.up = ops.FusedLinearReLU(dim, hidden) if fused else nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.softmax = ops.Softmax(dim=-1) if fused else nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = self.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads))
        attn = self.proj((scores @ v).transpose(1, 2).reshape(b, t, d))
        if self.fused:
            normed, x = self.norm2(attn, x)  # the residual add is fused into the norm
            return x + self.down(self.up(normed))
        x = x + attn
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class TinyModel(nn.Module):
    """Two blocks and a ReLU+LayerNorm head: every opbuilder layer is on the path."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 256, fused: bool = True) -> None:
        super().__init__()
        import opbuilder.ops as ops

        self.blocks = nn.ModuleList([Block(dim, heads, hidden, fused) for _ in range(2)])
        self.fused = fused
        self.head_norm = ops.FusedReLULayerNorm(dim) if fused else nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        x = self.head_norm(x) if self.fused else self.head_norm(torch.relu(x))
        return self.head(x)


def twin_models(device: str, dim: int = 64, seed: int = 0) -> tuple[TinyModel, TinyModel]:
    """(opbuilder model, PyTorch model) with identical weights."""
    torch.manual_seed(seed)
    fused = TinyModel(dim=dim, fused=True).to(device)
    plain = TinyModel(dim=dim, fused=False).to(device)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float = 1e-2) -> tuple[list[float], float]:
    """Losses of each step and the median seconds per step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, times = [], []
    for x, y in batches:
        if x.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    return losses, sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args(argv)

    import opbuilder

    started = time.perf_counter()
    opbuilder.prepare()  # compiles every op not yet in the cache, in parallel; a no-op when warm
    print(f"ops ready in {time.perf_counter() - started:.1f} s (cache: {opbuilder.env.cache_root()})")

    fused, plain = twin_models(args.device, dim=args.dim)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(args.batch, args.seq, args.dim, generator=gen).to(args.device),
         torch.randn(args.batch, args.seq, args.dim, generator=gen).to(args.device))
        for _ in range(args.steps)
    ]
    ours, ours_time = train(fused, batches)
    theirs, theirs_time = train(plain, batches)
    print(f"{'step':>4}  {'opbuilder loss':>14}  {'PyTorch loss':>12}")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        print(f"{i:>4}  {a:>14.6f}  {b:>12.6f}")
    print(f"time per step on {args.device}: opbuilder {ours_time * 1e3:.2f} ms, PyTorch {theirs_time * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
