"""The GPU kernels of one training step, ours beside PyTorch's twin (issue 23): torch.profiler's CUDA activity
over a few steps, device time per step by kernel, and the step's total device time.

    python benchmarks/tuning/step_kernels.py [--model FFNModel|Model] [--size DIM,HIDDEN,TOKENS] [--rows N]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallel_models import FFNModel, Model, twins  # noqa: E402
from train_step import _step  # noqa: E402


def kernels(model, x, target, steps: int) -> dict[str, tuple[float, int]]:
    """Kernel name -> (device us per step, launches per step)."""
    for _ in range(3):
        _step(model, x, target)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(model, x, target)
        torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name][0] += e.device_time / steps
            out[e.name][1] += 1 / steps
    return {k: (v[0], round(v[1])) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("FFNModel", "Model"), default="FFNModel")
    p.add_argument("--size", default="1024,4096,8192", metavar="DIM,HIDDEN,TOKENS")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=22)
    args = p.parse_args()
    dim, hidden, tokens = (int(v) for v in args.size.split(","))
    cls = {"FFNModel": FFNModel, "Model": Model}[args.model]
    ours, plain = twins(cls, dim, hidden, torch.bfloat16, "cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, dim, generator=g).to("cuda", torch.bfloat16)
    target = torch.randn(tokens, dim, generator=g).to("cuda")
    for label, model in (("ours", ours), ("pytorch", plain)):
        table = kernels(model, x, target, args.steps)
        total = sum(t for t, _ in table.values())
        print(f"\n{args.model} {args.size} {label}: {total:.1f} us of kernels a step, "
              f"{sum(n for _, n in table.values())} launches")
        for name, (t, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:args.rows]:
            print(f"{t:9.1f} us {n:3d}x  {name[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
