"""opbuilder on one node of several GPUs (issue 17): a build on an empty cache by every rank at once, then a
training step of a model from opbuilder's layers beside the same model from PyTorch's layers, under DDP,
FSDP2 (``fully_shard``) and tensor + sequence parallelism.

    torchrun --nproc_per_node 8 benchmarks/multi_gpu.py [--device cuda|cpu] [--backend nccl|gloo]
                                                       [--steps K] [--json FILE]
    # checked on a CPU, the same code path with gloo:
    OPB_CACHE_DIR=$(mktemp -d) torchrun --nproc_per_node 2 benchmarks/multi_gpu.py --device cpu --backend gloo --steps 3

Defaults: cuda + nccl when CUDA is available, else cpu + gloo; bf16 on CUDA, fp32 on a CPU.

1. Build: every rank calls each op once, each starting at a different op, so different ops compile at once.
   Per op: how many builds ran (the "opbuilder: building" lines all ranks printed), how many build folders
   appeared in the cache (both must be 1 on an empty cache, at most 1 on a warm one), and each rank's wall
   time for its first call (its own build, or its wait for another rank's).
2. Equality: the first step of each plan, both models from the same weights on the same data: the loss and
   every parameter's gradient of ours equal PyTorch's within the dtype's tolerance (relative norm error).
3. Speed: steps per second (forward, backward, SGD step) of both models under each plan, the slowest rank's
   time, in rounds that run both in a shuffled order (every rank the same: benchmarks/paired.py); the median
   round of each, and the ratio ours / PyTorch as the median of the rounds' ratios with its 95 % interval and
   where that lies against 1 (>1, <1, or ~1: holds it). Printed by rank 0 and written to --json.

Exit status 1 when a check failed on any rank. The models are benchmarks/parallel_models.py's (DDP and FSDP2:
``FFNModel``, with FusedLinearReLU; TP+SP: ``Model``, whose linears tensor parallelism splits).
"""

from __future__ import annotations

import os

# NVLink multicast (NVLS) off before anything initialises NCCL, here and in every process started from here.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import opbuilder.ops as ops  # noqa: E402
from opbuilder import env  # noqa: E402
from opbuilder.torchop import cxx_autograd
from opbuilder.jit.registry import names  # noqa: E402
from paired import coverage, interleave, ratio, verdict  # noqa: E402
from parallel_models import FFNModel, Model, exit_rank, sequence_parallel, twins  # noqa: E402  (beside this script)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: Largest ||ours - pytorch|| / ||pytorch|| of the loss; gradients get 2.5 times as much (as `opbuilder bench`).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SIZES = {"cpu": {"dim": 64, "hidden": 256, "batch": 4, "seq": 64},
         "cuda": {"dim": 1024, "hidden": 4096, "batch": 8, "seq": 1024}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    p.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--steps", type=int, default=20, help="timed steps per model and round (default 20)")
    p.add_argument("--rounds", type=int, default=9, help="rounds, each running both models in a shuffled order (default 9; 6 or "
                   "more give a 95 %% interval, 9 or more one narrower than the range of the ratios)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first (default 2)")
    for name in ("dim", "hidden", "batch", "seq"):
        p.add_argument(f"--{name}", type=int, help=f"default: {SIZES['cpu'][name]} on cpu, {SIZES['cuda'][name]} on cuda")
    p.add_argument("--json", metavar="FILE", help="write every number and check here (rank 0)")
    args = p.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected 1 or more, got {getattr(args, name)}")
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    for name, value in SIZES[args.device].items():
        setattr(args, name, getattr(args, name) or value)
    return args


# ---- 1. build --------------------------------------------------------------------------------------------


class CountBuilds:
    """stderr, passed through, counting opbuilder's "building <op>" lines (opbuilder.jit.build.say)."""

    def __init__(self, stream) -> None:
        self.stream, self.counts = stream, {}

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.startswith("opbuilder: building "):
                op = line.split()[2]
                self.counts[op] = self.counts.get(op, 0) + 1
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def first_calls(device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """One call of each built-in op, by the op's registry name."""
    x, r = torch.randn(4, 8, device=device, dtype=dtype), torch.randn(4, 8, device=device, dtype=dtype)
    w, b = torch.randn(8, device=device, dtype=dtype), torch.randn(8, device=device, dtype=dtype)
    calls = {
        "relu": lambda: ops.relu(x),
        "fused_add_rmsnorm": lambda: ops.fused_add_rmsnorm(x, r, w),
        "fused_relu_layernorm": lambda: ops.fused_relu_layernorm(x, w, b),
        "softmax": lambda: ops.softmax(x),
        "fused_matmul_add_relu": lambda: ops.fused_matmul_add_relu(x, r.T, b[:4]),
    }
    if set(calls) != set(names()):
        raise ValueError(f"multi_gpu.py calls {sorted(calls)}, the registry has {sorted(names())}: update first_calls")
    return calls


def builds_in_cache(since: float = 0.0) -> dict[str, int]:
    """Per op, the build folders in the cache whose build started at ``since`` or later."""
    counts = {}
    for op in names():
        folder = env.cache_root() / op
        found = [d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")] if folder.is_dir() else []
        counts[op] = sum(1 for d in found if json.loads((d / "manifest.json").read_text())["build_started"] >= since)
    return counts


def build_everything(device: torch.device, dtype: torch.dtype, checks: list[dict]) -> dict[str, dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = first_calls(device, dtype)
    before = builds_in_cache() if rank == 0 else None
    started = time.time()
    dist.barrier()  # every rank starts at once
    order = names()[rank % len(calls):] + names()[:rank % len(calls)]
    waited, counter = {}, CountBuilds(sys.stderr)
    sys.stderr = counter
    try:
        for op in order:
            t0 = time.perf_counter()
            calls[op]()
            synchronize(device)
            waited[op] = time.perf_counter() - t0
    finally:
        sys.stderr = counter.stream
    everyone = gather((waited, counter.counts))
    dist.barrier()
    new = builds_in_cache(since=started) if rank == 0 else None
    report = {}
    for op in names():
        builds = sum(counts.get(op, 0) for _, counts in everyone)
        report[op] = {"builds": builds, "first_call_s": [w[op] for w, _ in everyone]}
        if rank == 0:
            cold = before[op] == 0
            report[op].update(new_folders=new[op], cold_cache=cold)
            ok = builds == new[op] == (1 if cold else builds) and builds <= 1
            checks.append({"name": f"build {op}: once", "ok": ok, "detail":
                           f"{builds} builds on {world} ranks, {new[op]} new build folders, "
                           f"{'empty' if cold else 'warm'} cache"})
    return report


# ---- 2. and 3. train -------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = full(got).double(), full(want).double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def plan_models(plan: str, mesh, args, dtype: torch.dtype, device: torch.device):
    """(ours, pytorch) wrapped for ``plan``, and this rank's batches (inputs laid out for the plan)."""
    rank = dist.get_rank()
    cls = Model if plan == "TP+SP" else FFNModel
    ours, theirs = twins(cls, args.dim, args.hidden, dtype, device)
    if plan == "DDP":
        ids = [device.index] if device.type == "cuda" else None
        ours, theirs = DDP(ours, device_ids=ids), DDP(theirs, device_ids=ids)
    elif plan == "FSDP2":
        for model in (ours, theirs):
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
    else:
        ours, theirs = sequence_parallel(ours, mesh), sequence_parallel(theirs, mesh)
    # Data parallel: each rank its own batch. Tensor parallel: one batch, split along the sequence.
    gen = torch.Generator().manual_seed(100 + (0 if plan == "TP+SP" else rank))
    batches = []
    for _ in range(2):
        x, y = (torch.randn(args.batch, args.seq, args.dim, generator=gen).to(device, dtype) for _ in range(2))
        batches.append((distribute_tensor(x, mesh, [Shard(1)]) if plan == "TP+SP" else x, y))
    return ours, theirs, batches


def make_step(model, batches) -> Callable[[int], torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(i: int, update: bool = True) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if update:
            opt.step()
        return loss.detach()

    return step


def compare(plan: str, ours, theirs, step_ours, step_theirs, dtype: torch.dtype) -> list[dict]:
    """The first step of both models: loss and gradients, before the optimizer moves anything."""
    tol = TOLERANCE[dtype]
    results = [("loss", relative_error(step_ours(0, False), step_theirs(0, False)), tol)]
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        results.append((f"grad {name.removeprefix('module.')}", relative_error(a.grad, b.grad), 2.5 * tol))
    return [{"name": f"{plan} {what}", "ok": err <= limit, "detail": f"relative error {err:.2e} (limit {limit:.0e})"}
            for what, err, limit in results]


def steps_per_second(step, device: torch.device, steps: int) -> float:
    """Steps per second of the slowest rank."""
    synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    synchronize(device)
    slowest = max(gather(time.perf_counter() - t0))
    return steps / slowest


def run_plan(plan: str, mesh, args, dtype: torch.dtype, device: torch.device) -> tuple[list[dict], dict]:
    ours, theirs, batches = plan_models(plan, mesh, args, dtype, device)
    step_ours, step_theirs = make_step(ours, batches), make_step(theirs, batches)
    checks = compare(plan, ours, theirs, step_ours, step_theirs, dtype)
    for i in range(args.warmup):
        step_ours(i), step_theirs(i)
    rounds = interleave({"ours": lambda: steps_per_second(step_ours, device, args.steps),
                         "pytorch": lambda: steps_per_second(step_theirs, device, args.steps)}, args.rounds)
    speed = {name: statistics.median(values) for name, values in rounds.items()}
    speed["ratio"], speed["ratio_low"], speed["ratio_high"] = ratio(rounds["ours"], rounds["pytorch"])
    speed["rounds"] = rounds
    del ours, theirs, step_ours, step_theirs  # DDP's reducer holds the group: freed before it is destroyed
    gc.collect()
    return checks, speed


# ---- report ----------------------------------------------------------------------------------------------


def print_report(args, builds: dict, checks: list[dict], speeds: dict) -> None:
    world = dist.get_world_size()
    print(f"\n{world} ranks, {args.device} / {args.backend}, {args.dtype}, dim {args.dim}, hidden {args.hidden}, "
          f"batch {args.batch} x seq {args.seq} a rank, cache {env.cache_root()}")
    print(f"\n{'op':<24}{'builds':>7}{'new folders':>13}  first call s (rank 0..{world - 1})")
    for op, r in builds.items():
        print(f"{op:<24}{r['builds']:>7}{r['new_folders']:>13}  " + " ".join(f"{s:.2f}" for s in r["first_call_s"]))
    failed = [c for c in checks if not c["ok"]]
    print(f"\nchecks: {len(checks) - len(failed)} of {len(checks)} passed")
    for c in failed:
        print(f"  FAILED {c['name']}: {c['detail']}")
    print(f"\nsteps/s (median of {args.rounds} rounds of {args.steps} steps, slowest rank; ratio: the median of the "
          f"rounds' ratios, in brackets its {coverage(args.rounds) * 100:.0f} % interval)")
    print(f"{'plan':<8}{'ours':>10}{'pytorch':>10}{'ratio':>8}  interval      against 1")
    for plan, s in speeds.items():
        print(f"{plan:<8}{s['ours']:>10.2f}{s['pytorch']:>10.2f}{s['ratio']:>8.2f}  [{s['ratio_low']:.2f}, "
              f"{s['ratio_high']:.2f}]  {verdict(s['ratio_low'], s['ratio_high'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.seq % world or args.hidden % world:
        raise ValueError(f"--seq ({args.seq}) and --hidden ({args.hidden}) must be multiples of the {world} ranks "
                         "(sequence and tensor parallelism split them)")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = DTYPES[args.dtype]
    mesh = init_device_mesh(args.device, (world,))

    checks: list[dict] = []
    builds = build_everything(device, dtype, checks)
    # The C++ gradient path (opbuilder.torchop.cxx_autograd), as a training job that has run once has it: built once
    # (the ranks wait on one lock), loaded by every rank before the timed steps.
    glue = cxx_autograd.load(wait=True)
    checks.append({"name": "C++ gradient path loaded", "ok": glue, "detail": cxx_autograd.state()})
    speeds = {}
    for plan in ("DDP", "FSDP2", "TP+SP"):
        plan_checks, speeds[plan] = run_plan(plan, mesh, args, dtype, device)
        # A check passes when it passed on every rank.
        for per_rank in zip(*gather(plan_checks)):
            bad = [f"rank {r}: {c['detail']}" for r, c in enumerate(per_rank) if not c["ok"]]
            checks.append({**per_rank[0], "ok": not bad, "detail": "; ".join(bad) or per_rank[0]["detail"]})
    ok = all(c["ok"] for c in gather(checks)[0])  # rank 0 holds the build checks
    if rank == 0:
        print_report(args, builds, checks, speeds)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"world_size": world, "config": vars(args), "torch": torch.__version__, "ok": ok,
                           "builds": builds, "checks": checks, "steps_per_s": speeds}, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_rank(main())
