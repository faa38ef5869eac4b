"""Diagnostic (issue 23): torch.profiler (CPU and CUDA runtime calls) of FusedLinearReLU's forward+backward
against nn.Linear + ReLU at 8192 x 1024 -> 4096 bf16, issued behind a GPU sleep, with a dense gradient.
    python benchmarks/tuning/linear_probe.py
"""
import time, torch, torch.nn as nn
from torch.profiler import ProfilerActivity, profile
import opbuilder.ops as ops
from opbuilder.torchop import cxx_autograd
cxx_autograd.load(wait=True)
M, K, N = 8192, 1024, 4096
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
ours = ops.FusedLinearReLU(K, N).cuda().bfloat16()
theirs = nn.Sequential(nn.Linear(K, N), nn.ReLU()).cuda().bfloat16()
for name, m in [("ours", ours), ("torch", theirs), ("ours", ours), ("torch", theirs)]:
    def fb():
        m(x).backward(g)
    for _ in range(5): fb()
    torch.cuda.synchronize(); torch.cuda._sleep(int(1e9))
    t0 = time.perf_counter()
    for _ in range(10): fb()
    print(name, f"host {1e6 * (time.perf_counter() - t0) / 10:.1f} us per fwd+bwd", flush=True)
    torch.cuda.synchronize()
for name, m in [("ours", ours), ("torch", theirs)]:
    def fb():
        m(x).backward(g)
    torch.cuda.synchronize(); torch.cuda._sleep(int(1e9))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10): fb()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    print(f"== {name}: self CPU us per 10 calls (count)")
    for e in rows[:24]:
        print(f"  {e.key[:70]:70s} {e.self_cpu_time_total:10.1f} ({e.count})")
