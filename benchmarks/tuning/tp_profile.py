"""Where a parallel step's time goes (issue 23): torch.profiler's CPU table on rank 0 for a plan of
benchmarks/multi_gpu.py (TP+SP by default), ours and PyTorch's layers, the step time of each and, on CUDA, the
GPU's kernel time a step: NCCL's collectives and the rest (compute), each summed over the kernels (overlap counts
twice), and the time the GPU ran any kernel (their union).

    torchrun --nproc_per_node 2 benchmarks/tuning/tp_profile.py [--plan TP+SP|FSDP2|DDP] [--steps N] [--rows N] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from multi_gpu import make_step, plan_models  # noqa: E402
from parallel_models import exit_rank  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--plan", choices=("TP+SP", "FSDP2", "DDP"), default="TP+SP")
    args = p.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    ours, theirs, batches = plan_models(args.plan, mesh, args, torch.bfloat16 if cuda else torch.float32, device)
    for label, model in (("ours", ours), ("pytorch", theirs)):
        step = make_step(model, batches)
        for i in range(3):
            step(i)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(i)
        sync()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for i in range(args.steps):
                step(i)
            sync()
        if rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
            text = f"== {label} ({args.plan}): step {ms:.2f} ms (rank 0, {args.steps} steps){_gpu_time(prof, args.steps)}; " \
                   f"profiler, by self CPU\n{table}\n"
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"tp_profile_{label}.txt").write_text(text)
            print("\n".join(text.splitlines()[: args.rows + 6]), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    exit_rank(0)


def _gpu_time(prof, steps: int) -> str:
    """The GPU's kernel time a step: NCCL's, the rest, and their union (the time any kernel ran)."""
    spans, nccl, other = [], 0.0, 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.elapsed_us() <= 0:
            continue
        spans.append((e.time_range.start, e.time_range.end))
        if "nccl" in e.name.lower():
            nccl += e.time_range.elapsed_us()
        else:
            other += e.time_range.elapsed_us()
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    if not spans:
        return ""
    return (f"; GPU a step: NCCL kernels {nccl / steps / 1e3:.2f} ms, other kernels {other / steps / 1e3:.2f} ms, "
            f"any kernel running {busy / steps / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
