"""Host time of FusedLinearReLU's op against torch's linear + relu on one GPU, behind a GPU sleep (so the
GPU never holds the host back): forward alone, forward and backward, and the backward alone next to the same
aten calls made from Python. A diagnostic of benchmarks/NOTES.md's training-step section.

    python benchmarks/tuning/linear_host.py
"""
import time, torch, torch.nn.functional as F
import opbuilder.ops as ops
from opbuilder import cxx_autograd
cxx_autograd.load(wait=True)
dev = "cuda"
for (M, K, N) in [(1024, 256, 1024), (8192, 1024, 4096)]:
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(K, N, device=dev, dtype=torch.bfloat16)
    W, b = lin.weight, lin.bias
    cases = {
        "ours fwd": lambda: ops.fused_matmul_add_relu(x, W.t(), b),
        "torch fwd": lambda: torch.relu(F.linear(x, W, b)),
        "ours addmm-only": lambda: torch.addmm(b, x, W.t()),
    }
    for name, f in cases.items():
        for _ in range(5): f()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(5):
            torch.cuda._sleep(int(4e8))
            t0 = time.perf_counter()
            for _ in range(20): f()
            best = min(best, (time.perf_counter() - t0) / 20 * 1e6)
            torch.cuda.synchronize()
        print(f"{M}x{K}x{N} {name:18s} host {best:7.1f} us/call", flush=True)
    xg = x.clone().requires_grad_()
    def step_ours():
        y = ops.fused_matmul_add_relu(xg, W.t(), b); y.backward(torch.ones_like(y))
    def step_torch():
        y = torch.relu(F.linear(xg, W, b)); y.backward(torch.ones_like(y))
    def step_py():
        with cxx_autograd.disabled():
            step_ours()
    g1 = torch.ones(M, N, device=dev, dtype=torch.bfloat16)
    yo = ops.fused_matmul_add_relu(xg, W.t(), b); yt = torch.relu(F.linear(xg, W, b))
    def bwd_ours(): torch.autograd.grad(yo, [xg, W, b], g1, retain_graph=True)
    def bwd_torch(): torch.autograd.grad(yt, [xg, W, b], g1, retain_graph=True)
    def mm_only():
        gp = torch.ops.aten.threshold_backward(g1, yo, 0); gp.mm(W); gp.t().mm(x).t(); gp.sum(0)
    for name, f in {"ours fwd+bwd": step_ours, "torch fwd+bwd": step_torch, "python-path fwd+bwd": step_py,
                    "ours bwd only": bwd_ours, "torch bwd only": bwd_torch, "bwd ops in python": mm_only}.items():
        for _ in range(3): f()
        torch.cuda.synchronize(); best = 1e9
        for _ in range(5):
            torch.cuda._sleep(int(4e8)); t0 = time.perf_counter()
            for _ in range(4): f()
            best = min(best, (time.perf_counter() - t0) / 4 * 1e6); torch.cuda.synchronize()
        print(f"{M}x{K}x{N} {name:18s} host {best:7.1f} us/step", flush=True)
