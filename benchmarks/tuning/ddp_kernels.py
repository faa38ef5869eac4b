"""The GPU kernels of a DDP training step, ours beside PyTorch's twin, and of the same models without DDP
(issue 23: a gain of 8-11 % on one GPU reads 0.98 under DDP at the same size a rank).

    torchrun --nproc_per_node 2 benchmarks/tuning/ddp_kernels.py [--rows N]

Rank 0 prints, for each of (DDP, alone) x (ours, PyTorch): the step's wall time (median of rounds) and
torch.profiler's device time per step by kernel.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from multi_gpu import make_step, parse_args, plan_models  # noqa: E402
from parallel_models import FFNModel, exit_rank, twins  # noqa: E402

from opbuilder.torchop import cxx_autograd  # noqa: E402


def kernel_table(step, steps: int) -> dict[str, float]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time / steps
    return out


def wall(step, steps: int) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> int:
    rows = int(sys.argv[sys.argv.index("--rows") + 1]) if "--rows" in sys.argv else 14
    args = parse_args([])
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    cxx_autograd.load(wait=True)
    ours, theirs, batches = plan_models("DDP", mesh, args, torch.bfloat16, device)
    alone_ours, alone_theirs = twins(FFNModel, args.dim, args.hidden, torch.bfloat16, device)
    steps = {"DDP ours": make_step(ours, batches), "DDP pytorch": make_step(theirs, batches),
             "alone ours": make_step(alone_ours, batches), "alone pytorch": make_step(alone_theirs, batches)}
    for step in steps.values():
        for i in range(3):
            step(i)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(9):
        for name, step in steps.items():
            times[name].append(wall(step, 10))
    tables = {name: kernel_table(step, 5) for name, step in steps.items()}
    if rank == 0:
        for name in steps:
            t = tables[name]
            print(f"\n{name}: step {statistics.median(times[name]):.0f} us (median of 9 rounds), kernels "
                  f"{sum(t.values()):.0f} us a step")
            for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:rows]:
                print(f"{v:9.1f} us  {k[:140]}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())
