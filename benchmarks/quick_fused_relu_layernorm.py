"""Quick timing of fused_relu_layernorm against PyTorch eager and torch.compile of
``layer_norm(relu(x), w, b)``.

GPU (default): issue 4's shapes in bf16, random inputs, triton.testing.do_bench medians (25 ms warm-up,
200 ms of repeats; do_bench flushes L2 between repeats), beside a device-to-device copy measured in the
same run. Byte models (minimal): forward reads x, writes y (2 x rows x hidden x 2 B); backward reads x
and dy, writes dx (3 x ...); forward + backward step (5 x ...). Targets (H100): 32768x4096 forward
>= 0.90 of copy, 4096x768 forward <= 7 us, 32768x4096 forward + backward >= 0.80 of copy and faster
than torch.compile. Then a profiler breakdown of our step at 32768x4096.

CPU (--cpu): fp32 4096x4096 with --threads threads (default 2): forward, and forward + backward,
against eager; median of --repeats runs. Target: forward at least 2x faster than eager.

Usage: python benchmarks/quick_fused_relu_layernorm.py [--cpu] [--threads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from opbuilder.ops.fused_relu_layernorm import fused_relu_layernorm, fused_relu_layernorm_backward_op
from opbuilder.ops.fused_relu_layernorm import fused_relu_layernorm_op

EPS = 1e-5
ROWS: list[dict] = []


def record(case: str, shape: str, dtype: torch.dtype, impl: str, us: float, nbytes: float, copy_gbs: float | None):
    gbs = nbytes / (us * 1e-6) / 1e9
    row = {"case": case, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "impl": impl,
           "us": round(us, 2), "gbs": round(gbs, 1), "copy_fraction": round(gbs / copy_gbs, 3) if copy_gbs else None}
    ROWS.append(row)
    print(f"{case:<10} {shape:<12} {row['dtype']:<9} {impl:<22} {us:>10.1f} us {gbs:>8.0f} GB/s"
          + (f" {row['copy_fraction']:.3f} of copy" if copy_gbs else ""), flush=True)
    return row


def eager(x, w, b):
    return F.layer_norm(torch.relu(x), (x.shape[-1],), w, b, EPS)


# ---- GPU ---------------------------------------------------------------------------------------------


def gpu_time_us(fn, grad_to_none=None) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    us = gpu_time_us(lambda: dst.copy_(src))
    gbs = 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9
    print(f"device-to-device copy: {gbs:.0f} GB/s (bytes read + written), 1 GiB, {us:.1f} us", flush=True)
    return gbs


def inputs(rows: int, hidden: int, dtype: torch.dtype, grad: bool = False):
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    b = (torch.randn(hidden, device="cuda") * 0.1).to(dtype)
    return [t.requires_grad_(grad) for t in (x, w, b)]


def check_against_fp32(rows: int, hidden: int, dtype: torch.dtype) -> None:
    x, w, b = inputs(rows, hidden, dtype, grad=True)
    y = fused_relu_layernorm(x, w, b, EPS)
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), gy)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    y32 = eager(x32, w32, b32)
    want = torch.autograd.grad(y32, (x32, w32, b32), gy.float())
    errs = [(a.float() - c).abs().max().item() / max(c.abs().max().item(), 1e-30) for a, c in zip((y, *got), (y32, *want))]
    print("  max |ours - fp32 ref| / max |ref|: y %.2e  dx %.2e  dw %.2e  db %.2e" % tuple(errs), flush=True)


def forward_case(rows: int, hidden: int, dtype: torch.dtype, copy_gbs: float, with_compile: bool) -> dict[str, float]:
    x, w, b = inputs(rows, hidden, dtype)
    impls = {"fused_relu_layernorm": lambda: fused_relu_layernorm(x, w, b, EPS), "eager": lambda: eager(x, w, b)}
    if with_compile:
        torch._dynamo.reset()
        compiled = torch.compile(eager, fullgraph=True, dynamic=False)
        impls["torch.compile"] = lambda: compiled(x, w, b)
    nbytes = 2 * rows * hidden * x.element_size()
    return {name: record("forward", f"{rows}x{hidden}", dtype, name, gpu_time_us(fn), nbytes, copy_gbs)["us"]
            for name, fn in impls.items()}


def step_case(rows: int, hidden: int, dtype: torch.dtype, copy_gbs: float, with_compile: bool) -> dict[str, float]:
    """Forward then backward with all-ones output gradients; input grads set to None each repeat."""
    x, w, b = inputs(rows, hidden, dtype, grad=True)
    gy = torch.ones(rows, hidden, device="cuda", dtype=dtype)
    fns = {"fused_relu_layernorm": lambda x, w, b: fused_relu_layernorm(x, w, b, EPS), "eager": eager}
    if with_compile:
        torch._dynamo.reset()
        fns["torch.compile"] = torch.compile(eager, fullgraph=True, dynamic=False)
    shape = f"{rows}x{hidden}"
    out = {}
    for name, fn in fns.items():
        us = gpu_time_us(lambda: fn(x, w, b).backward(gy), grad_to_none=[x, w, b])
        out[name] = record("fwd+bwd", shape, dtype, name, us, 5 * rows * hidden * x.element_size(), copy_gbs)["us"]
    # Backward alone: the op's own kernels, and autograd.grad on a kept graph for each implementation.
    _, mean, rstd = fused_relu_layernorm_op()(x.detach(), w.detach(), b.detach(), EPS)
    bwd = fused_relu_layernorm_backward_op()
    nbytes = 3 * rows * hidden * x.element_size()
    us = gpu_time_us(lambda: bwd(gy, x.detach(), w.detach(), mean, rstd, True))
    out["backward_op"] = record("backward", shape, dtype, "backward op (kernels)", us, nbytes, copy_gbs)["us"]
    for name, fn in fns.items():
        try:
            y = fn(x, w, b)
            us = gpu_time_us(lambda: torch.autograd.grad(y, (x, w, b), gy, retain_graph=True))
            record("backward", shape, dtype, name, us, nbytes, copy_gbs)
        except (RuntimeError, AssertionError, NotImplementedError) as e:  # compiled backward may refuse retain_graph
            print(f"backward   {shape:<12} {name}: n/a ({str(e).splitlines()[0][:80]})", flush=True)
    return out


def profile_step(rows: int, hidden: int, dtype: torch.dtype) -> None:
    from torch.profiler import ProfilerActivity, profile

    x, w, b = inputs(rows, hidden, dtype, grad=True)
    gy = torch.ones(rows, hidden, device="cuda", dtype=dtype)
    for _ in range(3):
        fused_relu_layernorm(x, w, b, EPS).backward(gy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            x.grad = w.grad = b.grad = None
            fused_relu_layernorm(x, w, b, EPS).backward(gy)
        torch.cuda.synchronize()
    print(f"\nprofile of 5 fwd+bwd steps at {rows}x{hidden} {dtype} (kernel time, us per step):", flush=True)
    # Self device time: the kernels themselves, not the ops that launched them.
    def self_us(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))

    events = sorted((e for e in prof.key_averages() if self_us(e) > 0), key=lambda e: -self_us(e))
    for e in events[:8]:
        print(f"  {self_us(e) / 5:9.1f}  x{e.count / 5:<4g} {e.key[:110]}", flush=True)
    print(f"  {sum(self_us(e) for e in events) / 5:9.1f}  all kernels", flush=True)


def run_gpu() -> int:
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    copy_gbs = copy_bandwidth()
    bf16 = torch.bfloat16
    for rows, hidden in ((4096, 768), (32768, 4096)):
        check_against_fp32(rows, hidden, bf16)
    small = forward_case(4096, 768, bf16, copy_gbs, with_compile=True)
    big = forward_case(32768, 4096, bf16, copy_gbs, with_compile=True)
    for rows, hidden in ((4096, 4096), (8192, 8192), (4096, 16384), (1024, 65536)):
        forward_case(rows, hidden, bf16, copy_gbs, with_compile=False)
    forward_case(4096, 4096, torch.float32, copy_gbs, with_compile=False)
    step_small = step_case(4096, 768, bf16, copy_gbs, with_compile=True)
    step_big = step_case(32768, 4096, bf16, copy_gbs, with_compile=True)
    step_case(8192, 8192, bf16, copy_gbs, with_compile=False)

    print("\nissue 4 targets (H100, bf16):", flush=True)
    big_frac = 2 * 32768 * 4096 * 2 / (big["fused_relu_layernorm"] * 1e-6) / 1e9 / copy_gbs
    step_frac = 5 * 32768 * 4096 * 2 / (step_big["fused_relu_layernorm"] * 1e-6) / 1e9 / copy_gbs
    checks = [
        ("32768x4096 forward >= 0.90 of copy", big_frac >= 0.90, f"{big_frac:.3f}"),
        ("4096x768 forward <= 7 us", small["fused_relu_layernorm"] <= 7.0, f"{small['fused_relu_layernorm']:.1f} us"),
        ("32768x4096 fwd+bwd >= 0.80 of copy", step_frac >= 0.80, f"{step_frac:.3f}"),
        ("32768x4096 fwd+bwd faster than torch.compile",
         step_big["fused_relu_layernorm"] < step_big["torch.compile"],
         f"{step_big['fused_relu_layernorm']:.1f} vs {step_big['torch.compile']:.1f} us"),
        ("4096x768 fwd+bwd (no target)", True,
         f"ours {step_small['fused_relu_layernorm']:.1f} us, compile {step_small['torch.compile']:.1f} us"),
    ]
    for name, ok, value in checks:
        print(f"  {'PASS' if ok else 'MISS'}  {name}: {value}", flush=True)
    profile_step(32768, 4096, bf16)
    return 0


# ---- CPU ---------------------------------------------------------------------------------------------


def cpu_time_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def run_cpu(threads: int, repeats: int) -> int:
    torch.set_num_threads(threads)
    rows = hidden = 4096
    x = torch.randn(rows, hidden)
    w, b = torch.rand(hidden) + 0.5, torch.randn(hidden) * 0.1
    print(f"CPU, {threads} threads, fp32 {rows}x{hidden}, median of {repeats}", flush=True)
    nbytes = 2 * rows * hidden * 4
    ours = record("forward", f"{rows}x{hidden}", torch.float32, "fused_relu_layernorm",
                  cpu_time_us(lambda: fused_relu_layernorm(x, w, b, EPS), repeats), nbytes, None)["us"]
    theirs = record("forward", f"{rows}x{hidden}", torch.float32, "eager",
                    cpu_time_us(lambda: eager(x, w, b), repeats), nbytes, None)["us"]
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    gy = torch.ones(rows, hidden)

    def step(fn):
        xg.grad = wg.grad = bg.grad = None
        fn(xg, wg, bg).backward(gy)

    s_ours = record("fwd+bwd", f"{rows}x{hidden}", torch.float32, "fused_relu_layernorm",
                    cpu_time_us(lambda: step(lambda *a: fused_relu_layernorm(*a, EPS)), repeats), 5 * nbytes / 2, None)
    s_theirs = record("fwd+bwd", f"{rows}x{hidden}", torch.float32, "eager",
                      cpu_time_us(lambda: step(eager), repeats), 5 * nbytes / 2, None)
    print(f"  forward speedup over eager: {theirs / ours:.2f}x ({'PASS' if theirs / ours >= 2 else 'MISS'} >= 2x); "
          f"fwd+bwd: {s_theirs['us'] / s_ours['us']:.2f}x", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="time the CPU kernels instead of the GPU ones")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (--cpu)")
    parser.add_argument("--repeats", type=int, default=15, help="CPU repeats (--cpu)")
    parser.add_argument("--json", help="write every row to this file")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: pass --cpu")
    torch.manual_seed(0)
    status = run_cpu(args.threads, args.repeats) if args.cpu else run_gpu()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
