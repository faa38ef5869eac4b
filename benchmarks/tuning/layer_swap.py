"""Diagnostic (issue 23): which of our layers costs host time in a training step. Starts from the PyTorch
twin of benchmarks/parallel_models.py's FFNModel and puts in one kind of our layers at a time; prints the
step time, and the host time of the forward alone and of the backward alone (each issued behind a GPU
sleep), per variant, median of rounds.
    python benchmarks/tuning/layer_swap.py [--size DIM,HIDDEN,TOKENS] [--model FFNModel|Model]
"""
import argparse, copy, statistics, sys, time
from pathlib import Path
import torch, torch.nn.functional as F
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parallel_models import FFNModel, Model, twins  # noqa: E402
from opbuilder.torchop import cxx_autograd  # noqa: E402

KINDS = ("norm1", "softmax", "norm2", "act", "up")


def swap(base, other, kinds):
    """A copy of ``base`` whose layers of ``kinds`` are ``other``'s."""
    m = copy.deepcopy(base)
    for bm, bo in zip(m.blocks, other.blocks):
        for k in kinds:
            if k in ("norm1", "softmax", "norm2", "act"):
                setattr(bm, k, copy.deepcopy(getattr(bo, k)))
    if "up" in kinds and hasattr(m, "up"):
        m.up = copy.deepcopy(other.up)
    return m


def fwd_bwd_host(model, x, target, n=4):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    t0 = time.perf_counter()
    losses = [F.mse_loss(model(x).float(), target) for _ in range(n)]
    t1 = time.perf_counter()
    for loss in losses:
        loss.backward()
    t2 = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    return (t1 - t0) / n, (t2 - t1) / n


def step_time(model, x, target, n=20):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n):
        F.mse_loss(model(x).float(), target).backward()
        for p in model.parameters():
            p.grad = None
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="256,1024,1024")
    p.add_argument("--model", default="FFNModel")
    p.add_argument("--rounds", type=int, default=11)
    a = p.parse_args()
    dim, hidden, tokens = (int(v) for v in a.size.split(","))
    cxx_autograd.load(wait=True)
    ours, plain = twins({"FFNModel": FFNModel, "Model": Model}[a.model], dim, hidden, torch.bfloat16, "cuda")
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(tokens, dim, device="cuda")
    variants = {"torch": copy.deepcopy(plain), "ours": copy.deepcopy(ours)}
    for k in KINDS:
        variants["torch+" + k] = swap(plain, ours, [k])
        variants["ours-" + k] = swap(ours, plain, [k])
    res = {name: {"step": [], "fwd": [], "bwd": []} for name in variants}
    for m in variants.values():
        for _ in range(3):
            step_time(m, x, target, 2)
    for _ in range(a.rounds):
        for name, m in variants.items():
            res[name]["step"].append(step_time(m, x, target))
            f, b = fwd_bwd_host(m, x, target)
            res[name]["fwd"].append(f); res[name]["bwd"].append(b)
    print(f"{a.model} {a.size} bf16, {torch.cuda.get_device_name()}, least (median) of {a.rounds} rounds; us per step")
    print(f"{'variant':16s} {'step':>17s} {'fwd host':>17s} {'bwd host':>17s}")
    for name in variants:
        print(f"{name:16s} " + " ".join(f"{min(v) * 1e6:8.1f} ({statistics.median(v) * 1e6:6.0f})"
                                         for v in res[name].values()), flush=True)


if __name__ == "__main__":
    main()
