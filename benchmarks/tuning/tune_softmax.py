"""Softmax forward launch plans side by side on the GPU, in one run: the default plan and the plans around it.

A plan is [path, threads, vpt, cluster] (kernels/softmax/softmax.cuh). Each plan runs through the op's
tuning entry point ``forward_with_plan`` on the same rotated random inputs, timed with opbuilder's own CUDA
timer (opbuilder/dispatch/timing.py), beside torch.softmax and a device-to-device copy measured in the same run (and a
copy of the case's own bytes: what moving them takes at that size).
Every plan's output is checked against torch.softmax first. benchmarks/NOTES.md records the runs.

    python3 benchmarks/tuning/tune_softmax.py [--json FILE]        (GPU machine)
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from opbuilder.dispatch.timing import CudaTimer, Timing, copy_bandwidth
from opbuilder.ops.softmax import namespace

CASES = [((4096, 4096), torch.bfloat16), ((16384, 32768), torch.bfloat16), ((4096, 4096), torch.float32),
         ((16384, 32768), torch.float32), ((32768, 4096), torch.bfloat16), ((32768, 1024), torch.bfloat16),
         ((32768, 8192), torch.float32), ((65536, 256), torch.float32)]
ROTATE_CACHE_MULTIPLE = 4


def candidate_plans(cols: int, dtype: torch.dtype) -> list[list[int]]:
    """Block plans of 1..8 vectors a thread that hold the row in one block or a cluster of up to 8."""
    vectors = cols * torch.finfo(dtype).bits // 128
    plans = []
    for vpt in (1, 2, 4, 8):
        for threads in (64, 128, 256, 512, 1024):
            if threads > 256 and vpt != 8:
                continue
            cluster = -(-vectors // (threads * vpt))
            if cluster > 8 or threads * vpt * cluster >= 2 * vectors:  # not at all, or half the threads idle
                continue
            plans.append([1, threads, vpt, cluster])
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = CudaTimer(device, budget_ms=100)
    timer.rounds = 2
    ns = namespace()
    copy = copy_bandwidth(timer)
    print(f"{torch.cuda.get_device_name()}: copy {copy['GBps']:.0f} GB/s", flush=True)
    results = {"device": torch.cuda.get_device_name(), "copy_GBps": copy["GBps"], "rows": []}
    for shape, dtype in CASES:
        nbytes = 2 * math.prod(shape) * torch.finfo(dtype).bits // 8
        sets = max(1, min(64, math.ceil(ROTATE_CACHE_MULTIPLE * timer.cache_bytes() / nbytes)))
        gen = torch.Generator(device=device).manual_seed(0)
        xs = [(4 * torch.randn(shape, device=device, generator=gen)).to(dtype) for _ in range(sets)]
        default = list(ns.default_plan(xs[0], False))
        out = torch.empty_like(xs[0])
        impls = {"copy (same bytes)": lambda i: out.copy_(xs[i % sets]),
                 "torch.softmax": lambda i: torch.softmax(xs[i % sets], -1)}
        for plan in [default] + [p for p in candidate_plans(shape[1], dtype) if p != default]:
            got = ns.forward_with_plan(xs[0], plan)
            err = (got.float() - torch.softmax(xs[0].float(), -1)).abs().max().item()
            if not err < 2e-2:
                print(f"  plan {plan}: WRONG (max abs err {err:.3g})", flush=True)
                continue
            name = f"plan {plan}" + (" (default)" if plan == default else "")
            impls[name] = lambda i, plan=plan: ns.forward_with_plan(xs[i % sets], plan)
        label = f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
        for name, fn in impls.items():
            us = Timing.pooled([timer.measure(fn) for _ in range(timer.rounds)]).summary()["us"]
            frac = nbytes / us / 1e3 / copy["GBps"]
            results["rows"].append({"case": label, "impl": name, "us": us, "of_copy": frac})
            print(f"{label:<22} {name:<34} {us:>9.1f} us  {frac:.3f} of copy", flush=True)
        impls.clear()  # the closures hold the inputs
        xs.clear()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
