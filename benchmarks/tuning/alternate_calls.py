"""Why FusedLinearReLU's forward costs more host time inside a training step than in a loop of its own
(issue 23, benchmarks/tuning/insitu_host.py): one call's host time in a loop of that call alone, and in a loop
that alternates it with other calls (a PyTorch linear, our softmax), behind a GPU sleep; ours beside
nn.Linear + ReLU. Also which cuBLAS/cuBLASLt libraries the process has mapped.

    python benchmarks/tuning/alternate_calls.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import opbuilder.ops as ops


def per_call(calls, timed: int, rounds: int = 9, reps: int = 100) -> float:
    """Least over rounds of the host us of calls[timed], each rep running every call in order."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e8))
        spent = 0.0
        for _ in range(reps):
            for i, c in enumerate(calls):
                if i == timed:
                    t = time.perf_counter()
                    c()
                    spent += time.perf_counter() - t
                else:
                    c()
        best = min(best, spent / reps * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> int:
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(1024, 256, device=dev, dtype=dt, requires_grad=True)
    ours = ops.FusedLinearReLU(256, 1024, device=dev, dtype=dt)
    plain = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU()).to(dev, dt)
    other = torch.nn.Linear(1024, 256).to(dev, dt)
    h = torch.randn(1024, 1024, device=dev, dtype=dt, requires_grad=True)
    sm = ops.Softmax(-1)
    with torch.no_grad():
        pass
    layers = {"ours FusedLinearReLU": lambda: ours(x), "nn.Linear + nn.ReLU": lambda: plain(x)}
    neighbours = {
        "alone": [],
        "after a PyTorch linear": [lambda: other(h)],
        "after our softmax": [lambda: sm(h)],
        "after both": [lambda: other(h), lambda: sm(h)],
    }
    print(torch.cuda.get_device_name(), "bf16, 1024 x 256 -> 1024, with a gradient; host us a call (least of 9 x 100)")
    for nname, ncalls in neighbours.items():
        row = []
        for lname, lcall in layers.items():
            row.append(f"{lname} {per_call(ncalls + [lcall], len(ncalls)):7.2f}")
        print(f"{nname:24s} " + "   ".join(row))
    maps = open("/proc/self/maps").read().splitlines()
    libs = sorted({ln.split()[-1] for ln in maps if "cublas" in ln})
    print("cuBLAS libraries mapped:", *libs, sep="\n  ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
