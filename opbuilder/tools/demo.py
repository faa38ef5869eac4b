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
    trainer = Trainer(model, lr)
    losses, times = zip(*(trainer.step(x, y) for x, y in batches)) if batches else ((), ())
    return list(losses), sorted(times)[len(times) // 2] if times else 0.0


class Trainer:
    """One model with its SGD optimizer; ``step(x, y)`` -> (loss, seconds the step took)."""

    def __init__(self, model: nn.Module, lr: float = 1e-2) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        if x.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        if x.is_cuda:
            torch.cuda.synchronize()
        return loss.item(), time.perf_counter() - started


#: Default sizes per device, where fusing pays on the machines this was tried on: at dim 64 and 256 tokens the
#: step is a few hundred small calls, each one's host time (a few us of Python) outweighs the memory the fused
#: kernels save, and the PyTorch block wins on a CPU. On a 2-core CPU, five runs each: dim 128 and 512 tokens
#: (seq 64) 1.00x slower to 1.05x faster, dim 128 and 1024 tokens (seq 128) 1.04x to 1.12x faster. The CUDA sizes
#: keep the GPU busy longer than the host takes to issue the calls.
DEFAULTS = {"cpu": {"dim": 128, "batch": 8, "seq": 128}, "cuda": {"dim": 1024, "batch": 8, "seq": 512}}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per model (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (default 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, help="default: 8")
    parser.add_argument("--seq", type=int, help="default: 128 on a CPU, 512 on CUDA")
    parser.add_argument("--dim", type=int, help="default: 128 on a CPU, 1024 on CUDA")
    args = parser.parse_args(argv)
    sizes = DEFAULTS["cuda" if args.device.startswith("cuda") else "cpu"]
    dim, batch, seq = args.dim or sizes["dim"], args.batch or sizes["batch"], args.seq or sizes["seq"]

    import opbuilder

    started = time.perf_counter()
    opbuilder.prepare()  # compiles every op not yet in the cache, in parallel; a no-op when warm
    from opbuilder.torchop import cxx_autograd

    cxx_autograd.load(wait=True)  # the ops' C++ gradient path, built once a torch version (a no-op when warm)
    print(f"ops ready in {time.perf_counter() - started:.1f} s (cache: {opbuilder.env.cache_root()})")

    fused, plain = twin_models(args.device, dim=dim)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(batch, seq, dim, generator=gen).to(args.device),
         torch.randn(batch, seq, dim, generator=gen).to(args.device))
        for _ in range(args.warmup + args.steps)
    ]
    trainers = {"opbuilder": Trainer(fused), "PyTorch": Trainer(plain)}
    losses: dict[str, list[float]] = {name: [] for name in trainers}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    first: dict[str, float] = {}
    # The two models take turns a step at a time, so a slow spell of the machine hits both alike; the first
    # steps (allocator, caches, the first call of each op) are kept apart from the steady state.
    for i, (x, y) in enumerate(batches):
        for name, trainer in trainers.items():
            loss, seconds = trainer.step(x, y)
            losses[name].append(loss)
            if i == 0:
                first[name] = seconds
            if i >= args.warmup:
                times[name].append(seconds)

    print(f"{dim=}, {batch=}, {seq=} on {args.device}, {torch.get_num_threads()} threads")
    print(f"{'step':>4}  {'opbuilder loss':>14}  {'PyTorch loss':>12}")
    for i, (a, b) in enumerate(zip(losses["opbuilder"], losses["PyTorch"])):
        print(f"{i:>4}  {a:>14.6f}  {b:>12.6f}")
    print(f"first step (one-time warm-up included): opbuilder {first['opbuilder'] * 1e3:.2f} ms, "
          f"PyTorch {first['PyTorch'] * 1e3:.2f} ms")
    if not args.steps:
        return
    ours, theirs = _median(times["opbuilder"]), _median(times["PyTorch"])
    print(f"steady state, median of {args.steps} steps after {args.warmup} warm-up steps: "
          f"opbuilder {ours * 1e3:.2f} ms, PyTorch {theirs * 1e3:.2f} ms per step")
    if ours <= theirs:
        print(f"the fused block is {theirs / ours:.2f}x as fast here")
    else:
        print(f"the fused block is {ours / theirs:.2f}x slower here: at this size the host time of each call "
              "(see benchmarks/host_overhead.py) outweighs the memory traffic fusing saves; try a larger --dim or --seq"
              + ("" if cxx_autograd.state() == "ready" else
                 f" (the C++ gradient path is {cxx_autograd.state()}: gradients took the slower Python path)"))


if __name__ == "__main__":
    main()
