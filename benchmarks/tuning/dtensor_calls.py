"""Host cost per call of each layer on DTensors (issue 23, item 3): ours against its PyTorch twin, forward and
forward + backward, on a 1-rank gloo mesh on the CPU (DTensor's dispatch is the same work on any mesh size).

    python benchmarks/tuning/dtensor_calls.py      (from the checkout's root; 16-wide rows, one thread)
"""
import os, time, gc, statistics, sys
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29577")
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
from torch import nn
import opbuilder.ops as ops
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from parallel_models import AddRMSNorm
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.set_num_threads(1)
D = 16
def dt(t, p=Shard(1)): return distribute_tensor(t, mesh, [p])
def params(m):
    for n, p in list(m.named_parameters()):
        setattr(m, n, nn.Parameter(dt(p.detach(), Replicate())))
    return m
x = dt(torch.randn(1, 4, D)).requires_grad_()
r = dt(torch.randn(1, 4, D)).requires_grad_()
cases = {
  "rmsnorm": (params(ops.RMSNorm(D)), params(nn.RMSNorm(D, eps=1e-6)), (x,)),
  "softmax": (ops.Softmax(-1), nn.Softmax(-1), (x,)),
  "relu": (ops.ReLU(), nn.ReLU(), (x,)),
  "add_rmsnorm": (params(ops.FusedAddRMSNorm(D)), params(AddRMSNorm(D)), (x, r)),
  "relu_layernorm": (params(ops.FusedReLULayerNorm(D)), None, (x,)),
}
ln = params(nn.LayerNorm(D))
cases["relu_layernorm"] = (cases["relu_layernorm"][0], lambda t: ln(torch.relu(t)), (x,))
def fwd(m, a):
    return m(*a)
def fwdbwd(m, a):
    out = m(*a)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
def timeit(f, n=300, rounds=7):
    for _ in range(20): f()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter() - t0) / n * 1e6)
    return min(ts)
gc.freeze()
for name, (ours, theirs, a) in cases.items():
    for label, f in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
        to = timeit(lambda: f(ours, a)); tt = timeit(lambda: f(theirs, a))
        print(f"{name:15s} {label:8s} ours {to:8.1f} us  torch {tt:8.1f} us  ratio {to/tt:5.2f}", flush=True)
dist.destroy_process_group()
