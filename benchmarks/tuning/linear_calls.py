"""Diagnostic (issue 23): host time per call of FusedLinearReLU's pieces on CUDA against nn.Linear + ReLU's,
at a model's shape and at a tiny one (layer_host.py found the layer's forward 1.46x PyTorch's at 1024x256x1024
where host_overhead.py's 16-element call is 0.6x): each issued behind a GPU sleep, least of 9 rounds of 200.

    python benchmarks/tuning/linear_calls.py
"""
import time

import torch
import torch.nn.functional as F

import opbuilder.ops as ops
import importlib
mod = importlib.import_module("opbuilder.ops.fused_matmul_add_relu")
from opbuilder.torchop import cxx_autograd


def host(f, n=200):
    best = float("inf")
    for _ in range(9):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


cxx_autograd.load(wait=True)
dt = torch.bfloat16
for m, k, n in ((1024, 256, 1024), (16, 16, 16), (8192, 1024, 4096)):
    x = torch.randn(m, k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=dt, requires_grad=True)
    xg = x.clone().requires_grad_(True)
    wt = w.detach().t()
    wtc = wt.contiguous()
    bd = b.detach()
    ops.fused_matmul_add_relu(x, wt, bd)
    op = mod.fused_matmul_add_relu_op()
    pkt = op._overloadpacket
    layer = ops.FusedLinearReLU(k, n).to("cuda", dt)
    lin = torch.nn.Linear(k, n).to("cuda", dt)
    rows = {
        "nograd op, w.t() view, bias": lambda: pkt.nograd(x, wt, bd),
        "nograd op, contiguous rhs, bias": lambda: pkt.nograd(x, wtc, bd),
        "nograd op, w.t() view, no bias": lambda: pkt.nograd(x, wt, None),
        "torch.addmm(b, x, w.t())": lambda: torch.addmm(bd, x, wt),
        "torch.mm(x, w.t())": lambda: torch.mm(x, wt),
        "relu(F.linear) no grad": lambda: torch.relu(F.linear(x, w.detach(), bd)),
        "ops.fused_matmul_add_relu no grad": lambda: ops.fused_matmul_add_relu(x, wt, bd),
        "FusedLinearReLU, x requires grad": lambda: layer(xg),
        "relu(nn.Linear), x requires grad": lambda: torch.relu(lin(xg)),
    }
    print(f"\n{m}x{k}x{n} bf16, host us per call (least of 9 rounds of 200, behind a GPU sleep)")
    for name, f in rows.items():
        f()
        print(f"{host(f):8.2f}  {name}", flush=True)
