"""Diagnostic (issue 23): host time of each of our layers against its PyTorch twin, at a model's shape
(bf16, requires_grad), forward alone and forward+backward, issued behind a GPU sleep (least of rounds), and the
forward+backward's CPU time of the whole process (every thread: the backward runs on the autograd engine's).
    python benchmarks/tuning/layer_host.py [--device cuda|cpu] [--tokens 1024] [--dim 256]
"""
import argparse, time, torch, torch.nn as nn, torch.nn.functional as F
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import opbuilder.ops as ops  # noqa: E402
from parallel_models import AddRMSNorm  # noqa: E402
from opbuilder.torchop import cxx_autograd  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument("--tokens", type=int, default=1024)
p.add_argument("--dim", type=int, default=256)
a = p.parse_args()
dev, dt = a.device, (torch.bfloat16 if a.device == "cuda" else torch.float32)
cxx_autograd.load(wait=True)
D, H = a.dim, 4 * a.dim
x = torch.randn(a.tokens, D, device=dev, dtype=dt, requires_grad=True)
xh = torch.randn(a.tokens, H, device=dev, dtype=dt, requires_grad=True)
r = torch.randn(a.tokens, D, device=dev, dtype=dt, requires_grad=True)
pairs = {
    "RMSNorm": (ops.RMSNorm(D), nn.RMSNorm(D, eps=1e-6), (x,)),
    "Softmax": (ops.Softmax(-1), nn.Softmax(-1), (xh,)),
    "ReLU": (ops.ReLU(), nn.ReLU(), (xh,)),
    "FusedAddRMSNorm": (ops.FusedAddRMSNorm(D), AddRMSNorm(D), (x, r)),
    "FusedReLULayerNorm": (ops.FusedReLULayerNorm(D), None, (x,)),
    "FusedLinearReLU": (ops.FusedLinearReLU(D, H), nn.Sequential(nn.Linear(D, H), nn.ReLU()), (x,)),
}
class ReluLN(nn.Module):
    def __init__(s, d): super().__init__(); s.ln = nn.LayerNorm(d)
    def forward(s, x): return s.ln(torch.relu(x))
pairs["FusedReLULayerNorm"] = (ops.FusedReLULayerNorm(D), ReluLN(D), (x,))

def first(out):
    return out[0] if isinstance(out, tuple) else out

def per_call(f, n, clock=time.perf_counter, sleep=True):
    """us per call of f over n calls by ``clock``, the device synchronised outside; with ``sleep`` (CUDA) the
    calls are issued behind a ~0.1 s GPU sleep, so that only the host's work is timed."""
    if dev == "cuda":
        torch.cuda.synchronize()
        if sleep:
            torch.cuda._sleep(int(2e8))
    t0 = clock()
    for _ in range(n):
        f()
    t = (clock() - t0) / n
    if dev == "cuda":
        torch.cuda.synchronize()
    return t * 1e6

def host(f, n):
    return per_call(f, n)

def cpu(f, n):  # the whole process's CPU time: the backward runs on the autograd engine's thread
    return per_call(f, n, time.process_time, sleep=False)

print(f"{dev} {dt} tokens {a.tokens} dim {D}: host us per call, least of 9 rounds")
print(f"{'layer':20s} {'fwd ours':>9s} {'fwd torch':>9s} {'ratio':>6s} {'f+b ours':>9s} {'f+b torch':>9s} {'ratio':>6s}"
      f" {'CPU ours':>9s} {'CPU torch':>9s} {'ratio':>6s}")
for name, (ours, theirs, args) in pairs.items():
    ours, theirs = ours.to(dev, dt), theirs.to(dev, dt)
    res = {}
    for label, m in (("ours", ours), ("torch", theirs)):
        fwd = lambda: m(*args)
        def fb():
            first(m(*args)).sum().backward()
        for _ in range(5):
            fwd(); fb()
        res[label] = (min(host(fwd, 100) for _ in range(9)), min(host(fb, 20) for _ in range(9)),
                      min(cpu(fb, 200) for _ in range(9)))
    (fo, bo, co), (ft, bt, ct) = res["ours"], res["torch"]
    print(f"{name:20s} {fo:9.2f} {ft:9.2f} {fo/ft:6.2f} {bo:9.2f} {bt:9.2f} {bo/bt:6.2f} {co:9.2f} {ct:9.2f} {co/ct:6.2f}",
          flush=True)
