"""Diagnostic (issue 23): where a host-bound step (FFNModel, dim 256, bf16) waits without working.

The fifth session's `train_step.py` run read ours at *less* CPU time per step than PyTorch's twin (3.19 against
3.29 ms) yet *more* wall time (3.28 against 3.16): time the host spends neither working nor issuing. This prints,
per model, over interleaved rounds (gc frozen): wall time, the process's CPU time and the main thread's CPU time
per step; and from torch.profiler (CPU and CUDA activities) the CUDA runtime calls a step makes, by name: count and
host time, so a call that waits (a synchronisation, cudaMalloc/cudaFree, a blocking copy) shows by name.

    python benchmarks/tuning/idle_probe.py [--size 256,1024,1024] [--rounds 15] [--steps 20]
"""
import argparse
import collections
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parallel_models import FFNModel, twins  # noqa: E402
from train_step import _step  # noqa: E402

from opbuilder.torchop import cxx_autograd  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--size", default="256,1024,1024")
p.add_argument("--rounds", type=int, default=15)
p.add_argument("--steps", type=int, default=20)
a = p.parse_args()
dim, hidden, tokens = (int(v) for v in a.size.split(","))
cxx_autograd.load(wait=True)
ours, plain = twins(FFNModel, dim, hidden, torch.bfloat16, "cuda")
x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
target = torch.randn(tokens, dim, device="cuda")
models = {"ours": ours, "torch": plain}
for m in models.values():
    for _ in range(5):
        _step(m, x, target)
torch.cuda.synchronize()

# Runtime calls per step, by name.
for name, m in models.items():
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            _step(m, x, target)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn"):
            rows.append((e.self_cpu_time_total / a.steps, e.count / a.steps, e.key))
    rows.sort(reverse=True)
    print(f"== {name}: CUDA runtime/driver calls per step (host us, count)")
    for us, n, key in rows[:14]:
        print(f"  {us:8.1f} us {n:6.1f}  {key}")
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA) / a.steps
    print(f"  GPU events per step: {kernels:.1f}", flush=True)
    # The backward's nodes (autograd's device thread): each node's whole apply, per step.
    nodes = sorted(((e.cpu_time_total / a.steps, e.count / a.steps, e.key) for e in prof.key_averages()
                    if e.key.startswith("autograd::engine::evaluate_function")), reverse=True)
    print(f"== {name}: backward nodes per step (host us incl. their calls, count); all: "
          f"{sum(n[0] for n in nodes):.1f} us, {sum(n[1] for n in nodes):.0f} nodes")
    for us, n, key in nodes[:12]:
        print(f"  {us:8.1f} us {n:6.1f}  {key.removeprefix('autograd::engine::evaluate_function: ')}")
    ops = sorted(((e.self_cpu_time_total / a.steps, e.count / a.steps, e.key) for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CPU), reverse=True)
    print(f"== {name}: top self CPU per step (us, count)")
    for us, n, key in ops[:16]:
        print(f"  {us:8.1f} us {n:6.1f}  {key[:90]}")

gc.collect()
gc.freeze()
gc.disable()
res = {n: collections.defaultdict(list) for n in models}
for _ in range(a.rounds):
    for name, m in models.items():
        torch.cuda.synchronize()
        w0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(a.steps):
            _step(m, x, target)
        w1, c1, t1 = time.perf_counter(), time.process_time(), time.thread_time()
        torch.cuda.synchronize()
        w2 = time.perf_counter()
        r = res[name]
        r["issue wall"].append((w1 - w0) / a.steps * 1e6)
        r["wall+sync"].append((w2 - w0) / a.steps * 1e6)
        r["process CPU"].append((c1 - c0) / a.steps * 1e6)
        r["main thread CPU"].append((t1 - t0) / a.steps * 1e6)
gc.enable()
print(f"== per step, median (least) of {a.rounds} rounds of {a.steps} steps, us")
for name, r in res.items():
    print(f"  {name:6s} " + "  ".join(f"{k} {statistics.median(v):7.1f} ({min(v):7.1f})" for k, v in r.items()))
o, t = res["ours"], res["torch"]
for k in o:
    print(f"  torch/ours {k}: {statistics.median(t[k]) / statistics.median(o[k]):.3f}")
