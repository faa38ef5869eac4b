"""Probe (issue 23): each layer's very first call inside a CUDA graph capture, no warm-up, in a fresh process per
layer, forward and backward: does the capture work, and does a replay compute what eager computes? PyTorch asks
for a warm-up before a capture; this shows what a user who skips it gets.

    python benchmarks/tuning/first_call_capture.py   (CUDA; the ops built in the cache beforehand)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

LAYERS = {"ReLU": "ops.ReLU()", "Softmax": "ops.Softmax(-1)", "RMSNorm": "ops.RMSNorm(256)",
          "FusedReLULayerNorm": "ops.FusedReLULayerNorm(256)", "FusedLinearReLU": "ops.FusedLinearReLU(256, 256)",
          "torch Linear + ReLU (for comparison)": "torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())"}

CODE = textwrap.dedent("""
    import copy, torch, opbuilder.ops as ops
    torch.manual_seed(0)
    layer = {make}.cuda()
    eager = copy.deepcopy(layer)
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
        y.square().sum().backward()
    new = torch.randn_like(x)
    with torch.no_grad():
        x.copy_(new)
    x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    x2 = new.clone().requires_grad_()
    want = eager(x2)
    want.square().sum().backward()
    print("forward max error", (y - want).abs().max().item(), "input grad max error", (x.grad - x2.grad).abs().max().item())
""")


def main() -> int:
    only = sys.argv[1:]
    for name, make in LAYERS.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        r = subprocess.run([sys.executable, "-c", CODE.format(make=make)], capture_output=True, text=True, timeout=300)
        last = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else r.stderr.strip()[-2500:]
        print(f"{name}: exit {r.returncode}: {last}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
