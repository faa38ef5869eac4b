"""Quick timing of fused_matmul_add_relu against PyTorch eager, torch.compile and cuBLAS alone.

GPU (default): the shapes of issue 3's target table in bf16, and the linear case in fp32 (TF32 off), random inputs,
triton.testing.do_bench medians (25 ms warm-up, 200 ms of repeats), beside a device-to-device copy
measured in the same run. Targets: full-shape bias 1x4096^3 bf16 <= 200 us, 8x2048^3 bf16 <= 210 us;
linear + vector bias + ReLU 4096^3 bf16 <= 1.02x torch._addmm_activation. Also forward + backward
of FusedLinearReLU against nn.Linear + nn.ReLU.

CPU (--cpu): fp32 4096^3 with the machine's threads: the op (vector and full bias) against the
matmul alone (target: within 1.05x) and eager; median of --cpu-repeats runs.

Usage: python benchmarks/quick_fused_matmul_add_relu.py [--cpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from opbuilder.ops.fused_matmul_add_relu import FusedLinearReLU, fused_matmul_add_relu

ROWS: list[dict] = []


def record(case: str, shape: str, dtype: torch.dtype, impl: str, us: float, flops: float, nbytes: float,
           copy_gbs: float | None) -> None:
    gbs = nbytes / (us * 1e-6) / 1e9
    row = {"case": case, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "impl": impl, "us": round(us, 1),
           "tflops": round(flops / (us * 1e-6) / 1e12, 1), "gbs": round(gbs, 1),
           "copy_fraction": round(gbs / copy_gbs, 3) if copy_gbs else None}
    ROWS.append(row)
    print(f"{case:<16} {shape:<18} {row['dtype']:<9} {impl:<26} {row['us']:>10.1f} us {row['tflops']:>7.1f} TFLOP/s"
          f" {row['gbs']:>8.1f} GB/s" + (f" {row['copy_fraction']:.3f} of copy" if copy_gbs else ""), flush=True)


# ---- GPU ---------------------------------------------------------------------------------------

def gpu_time_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    us = gpu_time_us(lambda: dst.copy_(src))
    gbs = 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9
    print(f"device-to-device copy: {gbs:.0f} GB/s (bytes read + written), 1 GiB, {us:.1f} us", flush=True)
    return gbs


def full_bias_case(b: int, m: int, n: int, k: int, dtype: torch.dtype, copy_gbs: float) -> dict[str, float]:
    a = torch.randn(b, m, k, device="cuda", dtype=dtype)
    w = torch.randn(b, k, n, device="cuda", dtype=dtype)
    c = torch.randn(b, m, n, device="cuda", dtype=dtype)
    compiled = torch.compile(lambda a, w, c: torch.relu(a @ w + c), fullgraph=True)
    impls = {
        "fused_matmul_add_relu": lambda: fused_matmul_add_relu(a, w, c),
        "eager relu(a@b+c)": lambda: torch.relu(a @ w + c),
        "baddbmm+relu_": lambda: torch.baddbmm(c, a, w).relu_(),
        "torch.compile": lambda: compiled(a, w, c),
        "matmul_only": lambda: a @ w,
    }
    ref = torch.relu(a.float() @ w.float() + c.float())
    err = (fused_matmul_add_relu(a, w, c).float() - ref).abs().max().item()
    print(f"  max |ours - fp32 ref| = {err:.3g}", flush=True)
    flops, nbytes = 2.0 * b * m * n * k, (b * m * k + b * k * n + 2 * b * m * n) * a.element_size()
    times = {}
    for name, fn in impls.items():
        times[name] = gpu_time_us(fn)
        record("mm_add_relu", f"{b}x{m}x{n}x{k}", dtype, name, times[name], flops, nbytes, copy_gbs)
    return times


def linear_case(m: int, n: int, k: int, dtype: torch.dtype, copy_gbs: float) -> dict[str, float]:
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    compiled = torch.compile(lambda x, w, bias: F.relu(F.linear(x, w, bias)), fullgraph=True)
    impls = {
        "fused_matmul_add_relu": lambda: fused_matmul_add_relu(x, w.t(), bias),
        "_addmm_activation": lambda: torch._addmm_activation(bias, x, w.t()),
        "eager relu(linear)": lambda: F.relu(F.linear(x, w, bias)),
        "torch.compile": lambda: compiled(x, w, bias),
        "matmul_only": lambda: x @ w.t(),
    }
    ref = torch.relu(x.float() @ w.float().t() + bias.float())
    err = (fused_matmul_add_relu(x, w.t(), bias).float() - ref).abs().max().item()
    print(f"  max |ours - fp32 ref| = {err:.3g}", flush=True)
    flops, nbytes = 2.0 * m * n * k, (m * k + k * n + n + m * n) * x.element_size()
    times = {}
    for name, fn in impls.items():
        times[name] = gpu_time_us(fn)
        record("mm_vecbias_relu", f"{m}x{n}x{k}", dtype, name, times[name], flops, nbytes, copy_gbs)
    return times


def train_step_case(m: int, n: int, k: int, dtype: torch.dtype, copy_gbs: float) -> dict[str, float]:
    fused = FusedLinearReLU(k, n, device="cuda", dtype=dtype)
    reference = nn.Sequential(nn.Linear(k, n, device="cuda", dtype=dtype), nn.ReLU())
    reference[0].load_state_dict(fused.state_dict())
    compiled = torch.compile(reference, fullgraph=True)
    x = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=dtype)

    def step(module):
        def run():
            x.grad = None
            for p in module.parameters():
                p.grad = None
            module(x).backward(grad)
        return run

    flops, nbytes = 6.0 * m * n * k, 0.0
    times = {}
    for name, module in {"FusedLinearReLU": fused, "eager Linear+ReLU": reference, "torch.compile": compiled}.items():
        times[name] = gpu_time_us(step(module))
        record("fwd+bwd layer", f"{m}x{n}x{k}", dtype, name, times[name], flops, nbytes, None)
    return times


def run_gpu() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    copy_gbs = copy_bandwidth()
    checks = {}
    t = full_bias_case(1, 4096, 4096, 4096, torch.bfloat16, copy_gbs)
    checks["full bias 1x4096^3 bf16 <= 200 us"] = (t["fused_matmul_add_relu"], t["fused_matmul_add_relu"] <= 200)
    t = full_bias_case(8, 2048, 2048, 2048, torch.bfloat16, copy_gbs)
    checks["full bias 8x2048^3 bf16 <= 210 us"] = (t["fused_matmul_add_relu"], t["fused_matmul_add_relu"] <= 210)
    t = linear_case(4096, 4096, 4096, torch.bfloat16, copy_gbs)
    ratio = t["fused_matmul_add_relu"] / t["_addmm_activation"]
    checks["linear vector bias 4096^3 bf16 <= 1.02x _addmm_activation"] = (round(ratio, 3), ratio <= 1.02)
    t = linear_case(4096, 4096, 4096, torch.float32, copy_gbs)
    ratio = t["fused_matmul_add_relu"] / t["_addmm_activation"]
    checks["linear vector bias 4096^3 fp32 vs _addmm_activation (ratio)"] = (round(ratio, 3), ratio <= 1.02)
    train_step_case(4096, 4096, 4096, torch.bfloat16, copy_gbs)
    return {"device": torch.cuda.get_device_name(), "copy_gbs": round(copy_gbs, 1), "checks": checks}


# ---- CPU ---------------------------------------------------------------------------------------

def cpu_times_us(impls: dict, repeats: int) -> dict[str, float]:
    """Median wall time of each, taken round-robin so that load from other processes hits all alike."""
    for fn in impls.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(repeats):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def run_cpu(repeats: int) -> dict:
    n = 4096
    print(f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
          flush=True)
    a, w = torch.randn(n, n), torch.randn(n, n)
    bias, full = torch.randn(n), torch.randn(n, n)
    impls = {
        "fused_matmul_add_relu vec": lambda: fused_matmul_add_relu(a, w, bias),
        "fused_matmul_add_relu full": lambda: fused_matmul_add_relu(a, w, full),
        "matmul_only": lambda: a @ w,
        "eager relu(a@b+c)": lambda: torch.relu(a @ w + full),
    }
    times = cpu_times_us(impls, repeats)
    for name in impls:
        record("cpu mm_add_relu", f"1x{n}x{n}x{n}", torch.float32, name, times[name], 2.0 * n**3, 4.0 * 4 * n * n, None)
    checks = {
        f"cpu vec bias / matmul <= 1.05": round(times["fused_matmul_add_relu vec"] / times["matmul_only"], 3),
        f"cpu full bias / matmul <= 1.05": round(times["fused_matmul_add_relu full"] / times["matmul_only"], 3),
    }
    return {"threads": torch.get_num_threads(), "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="time the CPU path instead of the GPU one")
    parser.add_argument("--cpu-repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows and checks to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    summary = run_cpu(args.cpu_repeats) if args.cpu else run_gpu()
    print("checks:")
    for name, value in summary["checks"].items():
        print(f"  {name}: {value}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**summary, "rows": ROWS}, fh, indent=1)


if __name__ == "__main__":
    main()
