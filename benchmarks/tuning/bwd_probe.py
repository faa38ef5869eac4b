"""Diagnostic: torch.profiler of FusedLinearReLU's backward alone against linear + relu's, on one GPU.
    python benchmarks/tuning/bwd_probe.py OUTDIR
"""
import sys, time, torch, torch.nn.functional as F
from pathlib import Path
from torch.profiler import ProfilerActivity, profile
import opbuilder.ops as ops
from opbuilder.torchop import cxx_autograd
cxx_autograd.load(wait=True)
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev = "cuda"
M, K, N = 1024, 256, 1024
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
lin = torch.nn.Linear(K, N, device=dev, dtype=torch.bfloat16)
W, b = lin.weight, lin.bias
xg = x.clone().requires_grad_()
g1 = torch.ones(M, N, device=dev, dtype=torch.bfloat16)
yo = ops.fused_matmul_add_relu(xg, W.t(), b); yt = torch.relu(F.linear(xg, W, b))
print("ours grad_fn", yo.grad_fn, [e for e in yo.grad_fn.next_functions])
print("torch grad_fn", yt.grad_fn, yt.grad_fn.next_functions)
def bwd_ours(): torch.autograd.grad(yo, [xg, W, b], g1, retain_graph=True)
def bwd_torch(): torch.autograd.grad(yt, [xg, W, b], g1, retain_graph=True)
def bwd_ours_back():
    yo.backward(g1, retain_graph=True)
def bwd_torch_back():
    yt.backward(g1, retain_graph=True)
def timeit(f, n=4):
    for _ in range(3): f()
    torch.cuda.synchronize(); best = 1e9
    for _ in range(7):
        torch.cuda._sleep(int(4e8)); t0 = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t0) / n * 1e6); torch.cuda.synchronize()
    return best
for name, f in [("ours grad", bwd_ours), ("torch grad", bwd_torch), ("ours backward", bwd_ours_back), ("torch backward", bwd_torch_back)]:
    print(f"{name:16s} host {timeit(f):7.1f} us", flush=True)
    W.grad = b.grad = xg.grad = None
for name, f in [("ours", bwd_ours), ("torch", bwd_torch)]:
    for _ in range(3): f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(10): f()
        torch.cuda.synchronize()
    t = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    (out / f"bwd_{name}.txt").write_text(t)
    prof.export_chrome_trace(str(out / f"bwd_{name}.json"))
    print(f"== {name}\n" + "\n".join(t.splitlines()[:30]), flush=True)
