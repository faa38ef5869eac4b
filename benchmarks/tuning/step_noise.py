"""Diagnostic (issue 23): how much a training step's time varies between identical copies of one model
(host-bound, dim 256). Prints per variant the median and min step time over interleaved rounds.
    python benchmarks/tuning/step_noise.py [--gc-off] [--rounds N]
"""
import argparse, copy, gc, statistics, sys, time
from pathlib import Path
import torch, torch.nn.functional as F
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parallel_models import FFNModel, twins  # noqa: E402
from layer_swap import fwd_bwd_host, step_time  # noqa: E402
from opbuilder.torchop import cxx_autograd  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--gc-off", action="store_true")
p.add_argument("--rounds", type=int, default=9)
p.add_argument("--size", default="256,1024,1024")
a = p.parse_args()
dim, hidden, tokens = (int(v) for v in a.size.split(","))
cxx_autograd.load(wait=True)
ours, plain = twins(FFNModel, dim, hidden, torch.bfloat16, "cuda")
x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
target = torch.randn(tokens, dim, device="cuda")
variants = {"torch": plain, "torch copy1": copy.deepcopy(plain), "torch copy2": copy.deepcopy(plain),
            "ours": ours, "ours copy1": copy.deepcopy(ours), "ours copy2": copy.deepcopy(ours)}
for m in variants.values():
    step_time(m, x, target, 3)
if a.gc_off:
    gc.collect(); gc.freeze(); gc.disable()
res = {n: {"step": [], "fwd": [], "bwd": []} for n in variants}
for _ in range(a.rounds):
    for n, m in variants.items():
        res[n]["step"].append(step_time(m, x, target) * 1e6)
        f, b = fwd_bwd_host(m, x, target)
        res[n]["fwd"].append(f * 1e6); res[n]["bwd"].append(b * 1e6)
print(f"gc off: {a.gc_off}; {a.size}; median (min) us over {a.rounds} rounds")
for n, r in res.items():
    print(f"{n:12s} " + "  ".join(f"{k} {statistics.median(v):7.1f} ({min(v):7.1f})" for k, v in r.items()), flush=True)
