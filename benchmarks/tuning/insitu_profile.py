"""A training step's host calls, ours beside PyTorch's, under torch.profiler (CPU ops and CUDA runtime calls),
each step issued behind a GPU sleep as benchmarks/tuning/insitu_host.py does: what the step calls and how long
each call takes there, and what runs inside one named layer's forward (``--layer``, e.g. ``up``).

    python benchmarks/tuning/insitu_profile.py [--model FFNModel|Model] [--layer up] [--steps 10]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallel_models import FFNModel, Model, twins  # noqa: E402


def step(model, x, target) -> None:
    F.mse_loss(model(x).float(), target).backward()
    for p in model.parameters():
        p.grad = None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("FFNModel", "Model"), default="FFNModel")
    p.add_argument("--size", default="256,1024,1024")
    p.add_argument("--layer", default="up")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args()
    dim, hidden, tokens = (int(v) for v in args.size.split(","))
    cls = {"FFNModel": FFNModel, "Model": Model}[args.model]
    models = dict(zip(("ours", "pytorch"), twins(cls, dim, hidden, torch.bfloat16, "cuda")))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, dim, generator=g).to("cuda", torch.bfloat16)
    target = torch.randn(tokens, dim, generator=g).to("cuda")
    for m in models.values():
        layer = m.get_submodule(args.layer)
        forward = layer.forward

        def wrapped(*a, _f=forward, **k):
            with record_function("LAYER"):
                return _f(*a, **k)

        layer.forward = wrapped
    for _ in range(3):
        for m in models.values():
            step(m, x, target)
    torch.cuda.synchronize()
    profs = {}
    for name, m in models.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                torch.cuda.synchronize()
                torch.cuda._sleep(int(1e8))
                step(m, x, target)
                torch.cuda.synchronize()
        profs[name] = prof
    for name, prof in profs.items():
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
        print(f"\n== {name}: top host calls by self CPU time, us per step (calls per step)")
        agg = defaultdict(lambda: [0.0, 0])
        for e in evs:
            agg[e.name][0] += e.self_cpu_time_total / args.steps
            agg[e.name][1] += 1
        for k, (t, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[: args.rows]:
            print(f"{t:9.1f} {n / args.steps:6.1f}  {k[:110]}")
        layers = [(e.time_range.start, e.time_range.end, e.thread) for e in evs if e.name == "LAYER"]
        inside = defaultdict(lambda: [0.0, 0])
        for e in evs:
            if e.name == "LAYER":
                continue
            for s, t, th in layers:
                if e.thread == th and s <= e.time_range.start and e.time_range.end <= t:
                    inside[e.name][0] += e.cpu_time_total / args.steps
                    inside[e.name][1] += 1
                    break
        total = sum(t - s for s, t, _ in layers) / args.steps
        print(f"-- inside {args.layer}'s forward ({total:.1f} us per step): total CPU time of each call, us per step")
        for k, (t, n) in sorted(inside.items(), key=lambda kv: -kv[1][0])[: args.rows]:
            print(f"{t:9.1f} {n / args.steps:6.1f}  {k[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
