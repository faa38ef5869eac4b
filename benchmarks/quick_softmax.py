"""Quick timing of softmax against PyTorch eager and torch.compile.

GPU (default): issue 4's target table. Forward, fp32 and bf16, 4096x4096 and 16384x32768; backward
(the op alone: read y and grad_y, write grad_x) and forward+backward steps at 32768x4096 bf16.
triton.testing.do_bench medians (L2 flushed before each repeat), random inputs, beside a
device-to-device copy measured in the same run. Byte models: forward 2 n e, backward 3 n e,
forward+backward 5 n e (n = rows x cols, e = bytes per element). Then a sweep of launch plans
([path, threads, vpt, cluster], see kernels/softmax/softmax.cuh) through the tuning ops, so one run
shows whether the default plan is the best one known.

CPU (--cpu): fp32 and bf16 4096x4096, forward and backward, with the machine's threads, against
torch; rounds interleaved (ours, torch, ours, ...) so a load that comes and goes hits both.

Usage: python benchmarks/quick_softmax.py [--cpu] [--no-sweep] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from opbuilder.ops.softmax import backward_op, namespace, softmax

ROWS: list[dict] = []


def record(case: str, shape: str, dtype: torch.dtype, impl: str, us: float, nbytes: float,
           copy_gbs: float | None, note: str = "") -> dict:
    gbs = nbytes / (us * 1e-6) / 1e9
    row = {"case": case, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "impl": impl,
           "us": round(us, 1), "gbs": round(gbs, 1),
           "copy_fraction": round(gbs / copy_gbs, 3) if copy_gbs else None, "note": note}
    ROWS.append(row)
    frac = f" {row['copy_fraction']:.3f} of copy" if copy_gbs else ""
    print(f"{case:<9} {shape:<12} {row['dtype']:<9} {impl:<26} {row['us']:>10.1f} us {row['gbs']:>8.1f} GB/s{frac}"
          f"{'  ' + note if note else ''}", flush=True)
    return row


def report_speedup(times: dict[str, float]) -> None:
    print(f"  speedup: {times['eager'] / times['ours']:.2f}x vs eager, "
          f"{times['compile'] / times['ours']:.2f}x vs compile", flush=True)


# ---- GPU ----------------------------------------------------------------------------------------


def gpu_time_us(fn, grad_to_none=None) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    us = gpu_time_us(lambda: dst.copy_(src))
    gbs = 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9
    print(f"device-to-device copy: {gbs:.0f} GB/s (bytes read + written), 1 GiB, {us:.1f} us", flush=True)
    return gbs


def candidate_plans(cols: int, dtype: torch.dtype, backward: bool) -> list[list[int]]:
    """A few plans around the default: block shapes with 1..8 vectors a thread, clusters, a 1024-thread
    block, the split path."""
    per = 128 // torch.finfo(dtype).bits
    vectors = cols // per
    plans = []
    vpts = (1, 2, 4) if backward else (2, 4, 8)
    for vpt in vpts:
        for threads in (64, 128, 256, 512):
            if threads > 256 and vpt != (4 if backward else 8):
                continue
            cluster = -(-vectors // (threads * vpt))
            if cluster <= 8 and (cluster == 1 or threads >= 128):
                plans.append([1, threads, vpt, cluster])
    big_vpt = 4 if backward else 8
    threads = 32 * -(-vectors // (32 * big_vpt))
    if threads <= 1024 and [1, threads, big_vpt, 1] not in plans:
        plans.append([1, threads, big_vpt, 1])
    plans.append([2, 256, 4, 1])
    return plans


def forward_case(rows: int, cols: int, dtype: torch.dtype, copy_gbs: float, sweep: bool) -> None:
    ns = namespace()
    x = torch.randn(rows, cols, device="cuda", dtype=dtype) * 3
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: torch.softmax(t, -1), dynamic=False)
    ref = torch.softmax(x.float(), -1)
    err = (softmax(x).float() - ref).abs().max().item()
    plan = ns.default_plan(x, False)
    shape = f"{rows}x{cols}"
    nbytes = 2 * x.numel() * x.element_size()
    times = {}
    for impl, fn in (("ours", lambda: softmax(x)), ("eager", lambda: torch.softmax(x, -1)),
                     ("compile", lambda: compiled(x))):
        times[impl] = gpu_time_us(fn)
        note = f"plan {plan}, max|err| {err:.2g}" if impl == "ours" else ""
        record("forward", shape, dtype, impl, times[impl], nbytes, copy_gbs, note)
    report_speedup(times)
    if sweep:
        for p in candidate_plans(cols, dtype, backward=False):
            if p == plan:
                continue
            try:
                plan_err = (ns.forward_with_plan(x, p).float() - ref).abs().max().item()
                us = gpu_time_us(lambda: ns.forward_with_plan(x, p))
            except RuntimeError as err:  # a plan this device cannot run
                print(f"  plan {p}: {str(err).splitlines()[0]}")
                continue
            record("forward", shape, dtype, f"plan {p}", us, nbytes, copy_gbs, f"max|err| {plan_err:.2g}")


def backward_case(rows: int, cols: int, dtype: torch.dtype, copy_gbs: float, sweep: bool) -> None:
    ns = namespace()
    shape = f"{rows}x{cols}"
    x = (torch.randn(rows, cols, device="cuda", dtype=dtype) * 3).requires_grad_()
    g = torch.randn(rows, cols, device="cuda", dtype=dtype)
    y = torch.softmax(x.detach(), -1)

    # The backward op alone: read y and grad_y, write grad_x.
    torch._dynamo.reset()
    compiled_bwd = torch.compile(lambda g, y: torch.ops.aten._softmax_backward_data(g, y, -1, dtype), dynamic=False)
    ref = torch.ops.aten._softmax_backward_data(g.float(), y.float(), -1, torch.float32)
    err = (backward_op()(y, g).float() - ref).abs().max().item()
    plan = ns.default_plan(y, True)
    nbytes = 3 * y.numel() * y.element_size()
    times = {}
    for impl, fn in (("ours", lambda: backward_op()(y, g)),
                     ("eager", lambda: torch.ops.aten._softmax_backward_data(g, y, -1, dtype)),
                     ("compile", lambda: compiled_bwd(g, y))):
        times[impl] = gpu_time_us(fn)
        note = f"plan {plan}, max|err| {err:.2g}" if impl == "ours" else ""
        record("backward", shape, dtype, impl, times[impl], nbytes, copy_gbs, note)
    report_speedup(times)

    # Forward + backward steps (the baselines' step, with random output gradients).
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: torch.softmax(t, -1), dynamic=False)
    nbytes = 5 * x.numel() * x.element_size()
    times = {}
    for impl, f in (("ours", softmax), ("eager", lambda t: torch.softmax(t, -1)), ("compile", compiled)):
        def step(f=f):
            torch.autograd.backward(f(x), g)

        step()
        times[impl] = gpu_time_us(step, grad_to_none=[x])
        record("fwd+bwd", shape, dtype, impl, times[impl], nbytes, copy_gbs)
    report_speedup(times)

    if sweep:
        nbytes = 3 * y.numel() * y.element_size()
        for p in candidate_plans(cols, dtype, backward=True):
            if p == plan:
                continue
            try:
                plan_err = (ns.backward_with_plan(y, g, p).float() - ref).abs().max().item()
                us = gpu_time_us(lambda: ns.backward_with_plan(y, g, p))
            except RuntimeError as err:
                print(f"  plan {p}: {str(err).splitlines()[0]}")
                continue
            record("backward", shape, dtype, f"plan {p}", us, nbytes, copy_gbs, f"max|err| {plan_err:.2g}")


def run_gpu(sweep: bool) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    copy_gbs = copy_bandwidth()
    for rows, cols in ((4096, 4096), (16384, 32768)):
        for dtype in (torch.float32, torch.bfloat16):
            forward_case(rows, cols, dtype, copy_gbs, sweep)
            torch.cuda.empty_cache()
    backward_case(32768, 4096, torch.bfloat16, copy_gbs, sweep)


# ---- CPU ----------------------------------------------------------------------------------------


def cpu_times_us(fns: dict, rounds: int = 5, per_round: int = 10) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def run_cpu() -> None:
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    src = torch.randn(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    copy_us = cpu_times_us({"copy": lambda: dst.copy_(src)})["copy"]
    copy_gbs = 2 * src.numel() * 4 / (copy_us * 1e-6) / 1e9
    print(f"copy into a preallocated buffer: {copy_gbs:.1f} GB/s (64 MiB)", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, 4096, dtype=dtype) * 3
        g = torch.randn(4096, 4096, dtype=dtype)
        y = torch.softmax(x, -1)
        n = x.numel() * x.element_size()
        t = cpu_times_us({"ours": lambda: softmax(x), "torch": lambda: torch.softmax(x, -1)})
        for impl in t:
            record("forward", "4096x4096", dtype, impl, t[impl], 2 * n, copy_gbs)
        print(f"  speedup: {t['torch'] / t['ours']:.2f}x vs torch", flush=True)
        t = cpu_times_us({"ours": lambda: backward_op()(y, g),
                          "torch": lambda: torch.ops.aten._softmax_backward_data(g, y, -1, dtype)})
        for impl in t:
            record("backward", "4096x4096", dtype, impl, t[impl], 3 * n, copy_gbs)
        print(f"  speedup: {t['torch'] / t['ours']:.2f}x vs torch", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="time the CPU kernels instead")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-plan sweep")
    parser.add_argument("--json", help="write every row to this file")
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        run_cpu()
    else:
        run_gpu(sweep=not args.no_sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
