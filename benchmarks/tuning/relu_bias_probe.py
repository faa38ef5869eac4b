"""FusedLinearReLU's backward, ReLU and bias terms: ATen's two passes (threshold_backward, then sum over the
rows) against relu_bias_backward's one, on the GPU: device time (CUDA events around each call, L2 flushed
before it, median) and host time a call (least of 9 rounds of 200 calls issued behind a GPU sleep).

    python benchmarks/tuning/relu_bias_probe.py [--shapes M,N ...] [--dtype bf16|fp16|fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from opbuilder.ops.fused_matmul_add_relu import relu_bias_backward_op

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def device_us(fn, reps: int = 50) -> float:
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_us(fn, calls: int = 200, rounds: int = 9) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=["8192,4096", "1024,1024", "16,16"])
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    op = relu_bias_backward_op()
    print(f"{torch.cuda.get_device_name()}, {args.dtype}; us: device (median), host (least)")
    print(f"{'shape':>12} {'aten dev':>9} {'ours dev':>9} {'ratio':>6} {'aten host':>10} {'ours host':>10} {'ratio':>6}")
    for shape in args.shapes:
        m, n = (int(v) for v in shape.split(","))
        g = torch.randn(m, n, device="cuda", dtype=dtype)
        y = torch.randn(m, n, device="cuda", dtype=dtype).relu_()

        def aten():
            gp = torch.ops.aten.threshold_backward(g, y, 0)
            return gp, gp.sum(0)

        def ours():
            return op(g, y)

        a, b = aten(), ours()
        assert torch.equal(a[0], b[0]), "grad_pre differs from threshold_backward's"
        torch.testing.assert_close(a[1].float(), b[1].float(), rtol=2e-2, atol=2e-2 * m ** 0.5)
        ad, od = device_us(aten), device_us(ours)
        ah, oh = host_us(aten), host_us(ours)
        print(f"{shape:>12} {ad:9.2f} {od:9.2f} {od / ad:6.2f} {ah:10.2f} {oh:10.2f} {oh / ah:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
