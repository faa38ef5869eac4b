"""fused_add_rmsnorm (bf16, hidden 4096) on the GPU: kernel configs side by side, the floors under them, and
where the forward+backward step's time goes, in one run.

* floors: an empty kernel, and a kernel with the forward's memory traffic but none of its arithmetic
  ("touch"), under the same timer; a torch copy of the same byte count.
* forward at 128, 4096 and 32768 rows: the op as built (its launcher), and forward_rows_kernel at explicit
  configs (kernels/fused_add_rmsnorm/fused_add_rmsnorm_kernel.cuh, the working tree's).
* forward+backward at 32768 rows: the op's autograd step as `opbuilder bench` times it, the same step through
  fused_add_rmsnorm_backward.two_grads (grad_input and grad_residual as two tensors written by the kernel;
  given one tensor for both, autograd clones it), their parts (forward, backward ops, a clone), and backward
  kernel configs.

Timing: opbuilder's own CUDA timer (opbuilder/dispatch/timing.py), input sets rotated beyond 4x the L2 as the
bench does, two rounds (the spread between them is the noise). Every config is checked against the op first.

  python3 benchmarks/tuning/quick_rmsnorm.py --build   here: nvcc -> build/quick_rms/libquick_rms.so
  OUT=dir python3 benchmarks/tuning/quick_rmsnorm.py   GPU machine (carry build/quick_rms; rebuilt if it does not load)
Writes $OUT/quick_rmsnorm.json and prints a table per case.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import math
import os
import statistics
import subprocess
import time
import traceback
from pathlib import Path

import torch
from tuning import NVCC_FLAGS, timing


ROOT = Path(__file__).resolve().parents[2]
LIB_DIR = ROOT / "build" / "quick_rms"
LIB_PATH = LIB_DIR / "libquick_rms.so"
OUT = Path(os.environ.get("OUT", "/tmp"))
EPS = 1e-6
HIDDEN = 4096
BF16 = torch.bfloat16
FWD = ["nv1 x512, tpr at run time", "nv1 x512 (launcher)", "nv2 x256", "nv4 x128",  # forward_rows_kernel (q_fwd)
       "nv8 x64", "nv2 x256 __ldcs", "nv2 x256 weight late",
       "atomic sum nv1 x512", "atomic sum nv2 x256", "atomic sum nv4 x128"]  # fwd_atomic_kernel
BWD = ["nv2 x256 (launcher)", "nv1 x512"]  # backward_rows_kernel configs (index into q_bwd)

QUICK_CU = r"""// Entry points for benchmarks/tuning/quick_rmsnorm.py (not part of the op): the working tree's kernel templates
// at explicit configs for bf16 hidden 4096, and two floors. No torch; called through ctypes.
#include <cuda_runtime.h>
#include <cstdint>

#include "fused_add_rmsnorm/fused_add_rmsnorm_kernel.cuh"

#define EXPORT extern "C" __attribute__((visibility("default")))
using namespace opb::fused_add_rmsnorm;
using bf = __nv_bfloat16;
constexpr int kNvec = 512;  // 16-byte packs in a row of 4096 bf16

__global__ void empty_kernel() {}

// The forward's memory traffic without its arithmetic: per 16-byte pack read input, residual and weight,
// write out and residual_out. One row a block of 512 threads.
__global__ void __launch_bounds__(512) touch_kernel(const uint4* __restrict__ x, const uint4* __restrict__ r,
                                                    const uint4* __restrict__ w, uint4* __restrict__ out,
                                                    uint4* __restrict__ rout) {
  const int64_t i = int64_t(blockIdx.x) * kNvec + threadIdx.x;
  const uint4 a = x[i], b = r[i], c = w[threadIdx.x];
  rout[i] = make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
  out[i] = make_uint4(a.x ^ c.x, a.y ^ c.y, a.z ^ c.z, a.w ^ c.w);
}

// Variant (twelfth session): forward_rows_kernel's row-in-registers forward with the row's sum of squares
// reduced by one shared-memory atomic per warp (zeroed before the loads return) instead of a loop over the
// warps' partial sums after the barrier: a shorter chain between the loads and the stores at 128 rows.
template <int NV, int TPR>
__global__ void __launch_bounds__(TPR) fwd_atomic_kernel(const bf* __restrict__ input, const bf* __restrict__ residual,
                                                         const bf* __restrict__ weight, bf* __restrict__ out,
                                                         bf* __restrict__ residual_out, int64_t rows, int nvec,
                                                         int tpr_arg, float inv_hidden, float eps) {
  using V = Vec<bf, 8>;
  __shared__ float total;
  if (threadIdx.x == 0) total = 0.f;
  const int64_t base = int64_t(blockIdx.x) * nvec;
  V a[NV], b[NV], w[NV], h[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int idx = threadIdx.x + j * TPR;
    a[j] = reinterpret_cast<const V*>(input)[base + idx];
    b[j] = reinterpret_cast<const V*>(residual)[base + idx];
    w[j] = reinterpret_cast<const V*>(weight)[idx];
  }
  __syncthreads();  // total's zero, before any warp adds to it (the loads are still in flight)
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float f[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = to_acc(a[j].v[k]) + to_acc(b[j].v[k]);
    from_acc_n(h[j], f);
    reinterpret_cast<V*>(residual_out)[base + threadIdx.x + j * TPR] = h[j];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float v = to_acc(h[j].v[k]);
      ss += v * v;
    }
  }
  ss = group_sum(ss, 32);
  if ((threadIdx.x & 31) == 0) atomicAdd(&total, ss);
  __syncthreads();
  const float rstd = rsqrtf(total * inv_hidden + eps);
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float f[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = to_acc(h[j].v[k]) * rstd * to_acc(w[j].v[k]);
    V o;
    from_acc_n(o, f);
    reinterpret_cast<V*>(out)[base + threadIdx.x + j * TPR] = o;
  }
}

struct Cfg {
  const void* fn;
  int threads;
};

Cfg fwd(int v) {
  switch (v) {
    case 0: return {(const void*)&forward_rows_kernel<bf, 1, true, false>, 512};
    case 1: return {(const void*)&forward_rows_kernel<bf, 1, true, false, 512>, 512};
    case 2: return {(const void*)&forward_rows_kernel<bf, 2, true, false, 256>, 256};
    case 3: return {(const void*)&forward_rows_kernel<bf, 4, true, false, 128>, 128};
    case 4: return {(const void*)&forward_rows_kernel<bf, 8, true, false, 64>, 64};
    case 5: return {(const void*)&forward_rows_kernel<bf, 2, true, true, 256>, 256};
    case 6: return {(const void*)&forward_rows_kernel<bf, 2, false, false, 256>, 256};
    case 7: return {(const void*)&fwd_atomic_kernel<1, 512>, 512};
    case 8: return {(const void*)&fwd_atomic_kernel<2, 256>, 256};
    case 9: return {(const void*)&fwd_atomic_kernel<4, 128>, 128};
  }
  return {nullptr, 0};
}

Cfg bwd(int v) {
  switch (v) {
    case 0: return {(const void*)&backward_rows_kernel<bf, 2>, 256};
    case 1: return {(const void*)&backward_rows_kernel<bf, 1>, 512};
  }
  return {nullptr, 0};
}

int occupancy(Cfg c, size_t smem) {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, c.fn, c.threads, smem);
  return n;
}

int sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

constexpr size_t kBwdSmem = 4096 * sizeof(float);  // one row slot of weight-gradient sums

EXPORT int q_info(int backward, int v, int* regs, int* local, int* occ) {
  const Cfg c = backward ? bwd(v) : fwd(v);
  if (c.fn == nullptr) return -1;
  cudaFuncAttributes a;
  const cudaError_t e = cudaFuncGetAttributes(&a, c.fn);
  *regs = a.numRegs;
  *local = static_cast<int>(a.localSizeBytes);
  *occ = occupancy(c, backward ? kBwdSmem : 0);
  return e;
}

EXPORT int q_empty(int blocks, int threads, cudaStream_t s) {
  empty_kernel<<<blocks, threads, 0, s>>>();
  return cudaGetLastError();
}

EXPORT int q_touch(const void* x, const void* r, const void* w, void* out, void* rout, int64_t rows, cudaStream_t s) {
  touch_kernel<<<static_cast<unsigned>(rows), 512, 0, s>>>((const uint4*)x, (const uint4*)r, (const uint4*)w,
                                                           (uint4*)out, (uint4*)rout);
  return cudaGetLastError();
}

EXPORT int q_fwd(int v, const bf* x, const bf* r, const bf* w, bf* out, bf* rout, int64_t rows, cudaStream_t s) {
  const Cfg c = fwd(v);
  if (c.fn == nullptr) return -1;
  int nvec = kNvec, tpr = c.threads;
  float inv_hidden = 1.f / 4096.f, eps = 1e-6f;
  void* args[] = {&x, &r, &w, &out, &rout, &rows, &nvec, &tpr, &inv_hidden, &eps};
  return cudaLaunchKernel(c.fn, dim3(static_cast<unsigned>(rows)), dim3(c.threads), args, 0, s);
}

// Blocks of the persistent backward grid (= rows of partial sums).
EXPORT int64_t q_bwd_grid(int v, int64_t rows) {
  const int64_t resident = int64_t(sms()) * occupancy(bwd(v), kBwdSmem);
  return rows < resident ? rows : resident;
}

// backward_rows_kernel, then weight_grad_kernel over its partial sums. gh2 may be null.
EXPORT int q_bwd(int v, const bf* gy, const bf* gr, const bf* h, const bf* w, bf* gh, bf* gh2, bf* gw, float* partial,
                 int64_t rows, cudaStream_t s) {
  const Cfg c = bwd(v);
  if (c.fn == nullptr) return -1;
  const int64_t grid = q_bwd_grid(v, rows);
  int nvec = kNvec, tpr = c.threads;
  float inv_hidden = 1.f / 4096.f, eps = 1e-6f;
  void* args[] = {&gy, &gr, &h, &w, &gh, &gh2, &partial, &rows, &nvec, &tpr, &inv_hidden, &eps};
  cudaError_t e = cudaLaunchKernel(c.fn, dim3(static_cast<unsigned>(grid)), dim3(c.threads), args, kBwdSmem, s);
  if (e != cudaSuccess) return e;
  weight_grad_kernel<bf><<<4096 / 32, dim3(32, 32), 0, s>>>(partial, gw, grid, 4096);
  return cudaGetLastError();
}
"""

results: dict = {"env": {}, "checks": [], "times": [], "info": {}}
LIB: ctypes.CDLL | None = None
c_void_p, c_int, c_int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "quick_rmsnorm.json").write_text(json.dumps(results, indent=1))


def build() -> None:
    LIB_DIR.mkdir(parents=True, exist_ok=True)
    (LIB_DIR / "quick_rms.cu").write_text(QUICK_CU)
    t0 = time.perf_counter()
    subprocess.run(["nvcc", *NVCC_FLAGS, str(LIB_DIR / "quick_rms.cu"), "-o", str(LIB_PATH)], cwd=ROOT, check=True)
    print(f"built {LIB_PATH.relative_to(ROOT)} in {time.perf_counter() - t0:.1f} s", flush=True)


def load() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(LIB_PATH))
    except OSError as e:
        print(f"{LIB_PATH.name} did not load ({e}); building it here", flush=True)
        build()
        lib = ctypes.CDLL(str(LIB_PATH))
    lib.q_info.argtypes = [c_int, c_int] + [ctypes.POINTER(c_int)] * 3
    lib.q_empty.argtypes = [c_int, c_int, c_void_p]
    lib.q_touch.argtypes = [c_void_p] * 5 + [c_int64, c_void_p]
    lib.q_fwd.argtypes = [c_int] + [c_void_p] * 5 + [c_int64, c_void_p]
    lib.q_bwd_grid.argtypes = [c_int, c_int64]
    lib.q_bwd_grid.restype = c_int64
    lib.q_bwd.argtypes = [c_int] + [c_void_p] * 8 + [c_int64, c_void_p]
    return lib


def ok(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: CUDA error {code}")


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def info(backward: int, v: int) -> dict:
    regs, local, occ = c_int(), c_int(), c_int()
    ok(LIB.q_info(backward, v, ctypes.byref(regs), ctypes.byref(local), ctypes.byref(occ)), "q_info")
    return {"regs": regs.value, "local_B": local.value, "blocks_per_sm": occ.value}


def set_count(footprint: int, timer: timing.CudaTimer) -> int:
    """As the bench: enough sets to span 4x the L2 (opbuilder/tools/bench/runner.py)."""
    wanted = math.ceil(4 * timer.cache_bytes() / footprint)
    return max(1, min(wanted, 256, timer.spare_bytes() // footprint))


NCU = False  # --ncu: launch each forward variant at the given rows once, time nothing (for ncu to profile)
ROUNDS = 2


def run_case(title: str, nbytes: int | dict | None, impls: dict, timer, copy_gbps: float, rounds: int = 0) -> None:
    """impls: name -> (step, reset or None); nbytes: the case's bytes, or each impl's (name -> bytes). Rounds
    take turns over the impls; prints one row each."""
    parts: dict[str, list] = {name: [] for name in impls}
    rounds = rounds or ROUNDS
    for _ in range(rounds):
        for name, (step, reset) in impls.items():
            parts[name].append(timer.measure(step, reset))
    floor = f"; floor at copy {nbytes / copy_gbps / 1e3:.1f} us" if isinstance(nbytes, int) else ""
    print(f"\n== {title}{f' ({nbytes} B{floor})' if isinstance(nbytes, int) else ''}", flush=True)
    print(f"{'impl':44s} {'median us':>9s} {' '.join(f'round {k + 1:<2d}' for k in range(rounds))} {'of copy':>7s}")
    for name, p in parts.items():
        meds = [statistics.median(t.samples_us) for t in p]
        us = statistics.median(x for t in p for x in t.samples_us)
        b = nbytes.get(name) if isinstance(nbytes, dict) else nbytes
        frac = b / us / 1e3 / copy_gbps if b else None
        results["times"].append(dict(case=title, impl=name, us=us, rounds_us=meds, bytes=b, frac_copy=frac,
                                     repeats=sum(len(t.samples_us) for t in p)))
        r = " ".join(f"{m:8.2f}" for m in meds)
        print(f"{name:44s} {us:9.2f} {r} {frac:7.3f}" if frac else f"{name:44s} {us:9.2f} {r}", flush=True)
    save()


def check(name: str, got: torch.Tensor, want: torch.Tensor, exact: bool = False) -> bool:
    if exact:
        good = bool(torch.equal(got, want))
        err = 0.0 if good else float("nan")
    else:
        err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
        good = bool(torch.isfinite(got).all()) and err < 1e-2
    results["checks"].append(dict(name=name, ok=good, rel_err=err))
    if not good:
        print(f"CHECK FAILED {name}: rel_err {err}", flush=True)
    return good


# ---- cases ---------------------------------------------------------------------------------------------


def forward_case(rows: int, timer, copy_gbps: float, fused_add_rmsnorm) -> None:
    footprint = (4 * rows * HIDDEN + HIDDEN) * 2
    count = set_count(footprint, timer)
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=gen).to(BF16)

    sets = [(randn(rows, HIDDEN), randn(rows, HIDDEN), randn(HIDDEN)) for _ in range(count)]
    # One pair of outputs for every set, as the op gets from the caching allocator call after call.
    out, rout = randn(rows, HIDDEN), randn(rows, HIDDEN)
    want_out, want_h = fused_add_rmsnorm(*sets[0], EPS)
    impls = {"op (its launcher)": (lambda i: fused_add_rmsnorm(*sets[i % count], EPS), None)}
    for v, name in enumerate(FWD):
        out.fill_(float("nan"))
        ok(LIB.q_fwd(v, *map(ptr, sets[0]), ptr(out), ptr(rout), rows, stream()), name)
        if check(f"fwd {rows} {name} out", out, want_out) & check(f"fwd {rows} {name} h", rout, want_h, exact=True):
            impls[name] = (
                lambda i, v=v: LIB.q_fwd(v, *map(ptr, sets[i % count]), ptr(out), ptr(rout), rows, stream()), None)
    try:
        from liger_kernel.transformers.functional import liger_fused_add_rms_norm
    except ImportError:
        liger_fused_add_rms_norm = None
    if liger_fused_add_rms_norm is not None:
        impls["Liger-Kernel"] = (lambda i: liger_fused_add_rms_norm(*sets[i % count], EPS, 0.0, "llama", False), None)
    if NCU:  # each launched once more, for ncu to read (warmed up above by the checks)
        for name, (step, _) in impls.items():
            step(0)
        torch.cuda.synchronize()
        print("ncu launches done:", ", ".join(impls), flush=True)
        return
    impls["touch (traffic, no arithmetic)"] = (
        lambda i: LIB.q_touch(*map(ptr, sets[i % count]), ptr(out), ptr(rout), rows, stream()), None)
    impls["empty kernel <<<rows, 512>>>"] = (lambda i: LIB.q_empty(rows, 512, stream()), None)
    src = [randn(2 * rows, HIDDEN) for _ in range(count)]
    dst = torch.empty_like(src[0])
    impls["torch copy, same bytes"] = (lambda i: dst.copy_(src[i % count]), None)
    run_case(f"forward bf16 {rows}x{HIDDEN} ({count} sets)", footprint, impls, timer, copy_gbps)


def backward_case(timer, copy_gbps: float, mod) -> None:
    rows = 32768
    fused_add_rmsnorm, lib = mod.fused_add_rmsnorm, mod._ops()
    two_grads = lib.fused_add_rmsnorm_backward.two_grads
    gen = torch.Generator(device="cuda").manual_seed(1)
    x, r = (torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(BF16).requires_grad_() for _ in range(2))
    w = torch.randn(HIDDEN, device="cuda", generator=gen).to(BF16).requires_grad_()
    gy, gr = (torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(BF16) for _ in range(2))
    leaves = (x, r, w)

    class TwoGrads(torch.autograd.Function):
        """The op's autograd through the backward's two_grads overload."""

        @staticmethod
        def forward(ctx, a, b, c):
            out, h = fused_add_rmsnorm(a, b, c, EPS)
            ctx.save_for_backward(h, c)
            return out, h

        @staticmethod
        def backward(ctx, g_out, g_h):
            h, c = ctx.saved_tensors
            return two_grads(g_out, g_h, h, c, EPS)

    def reset(i: int) -> None:
        for t in leaves:
            t.grad = None

    def grads_of(fn):
        reset(0)
        torch.autograd.backward(fn(x, r, w), (gy, gr))
        got = [t.grad for t in leaves]
        reset(0)
        return got

    base = grads_of(lambda a, b, c: fused_add_rmsnorm(a, b, c, EPS))
    two = grads_of(TwoGrads.apply)
    step_ok = all(check(f"two_grads step {n}", g, b, exact=True) for n, g, b in zip("xrw", two, base))
    step_ok &= two[0].data_ptr() != two[1].data_ptr()
    with torch.no_grad():
        h = (x + r).contiguous()
    nbytes = (8 * rows * HIDDEN + 3 * HIDDEN) * 2
    impls = {
        "step: the op's autograd (as the bench)": (
            lambda i: torch.autograd.backward(fused_add_rmsnorm(x, r, w, EPS), (gy, gr)), reset),
    }
    if step_ok:
        impls["step: two_grads through autograd.Function"] = (
            lambda i: torch.autograd.backward(TwoGrads.apply(x, r, w), (gy, gr)), reset)
    run_case(f"forward+backward bf16 {rows}x{HIDDEN} (bench's byte model)", nbytes, impls, timer, copy_gbps)

    gh, gh2, gw = torch.empty_like(h), torch.empty_like(h), torch.empty_like(w)
    want = lib.fused_add_rmsnorm_backward.default(gy, gr, h, w, EPS)
    parts = {
        "forward op": (lambda i: fused_add_rmsnorm(x.detach(), r.detach(), w.detach(), EPS), None),
        "backward op, one grad": (lambda i: lib.fused_add_rmsnorm_backward.default(gy, gr, h, w, EPS), None),
        "backward op, two_grads": (lambda i: two_grads(gy, gr, h, w, EPS), None),
        "clone of grad_h (autograd's)": (lambda i: want[0].clone(), None),
    }
    for v, name in enumerate(BWD):
        partial = torch.empty(LIB.q_bwd_grid(v, rows), HIDDEN, device="cuda", dtype=torch.float32)
        for second in (None, gh2):
            label = f"bwd kernel {name}, {'two grads' if second is not None else 'one grad'}"
            gh.fill_(float("nan"))
            ok(LIB.q_bwd(v, ptr(gy), ptr(gr), ptr(h), ptr(w), ptr(gh), ptr(second), ptr(gw), ptr(partial), rows,
                         stream()), label)
            good = check(f"{label} grad_h", gh, want[0]) & check(f"{label} grad_w", gw, want[1])
            if second is not None:
                good &= check(f"{label} grad_h2", second, gh, exact=True)
            if good:
                parts[label] = (lambda i, v=v, p=partial, s=second: LIB.q_bwd(
                    v, ptr(gy), ptr(gr), ptr(h), ptr(w), ptr(gh), ptr(s), ptr(gw), ptr(p), rows, stream()), None)
    n = rows * HIDDEN * 2  # one full tensor's bytes; "of copy" counts each part's full tensors read + written
    tensors = {"forward op": 4, "backward op, one grad": 4, "backward op, two_grads": 5,
               "clone of grad_h (autograd's)": 2}
    nbytes = {name: k * n for name, k in tensors.items()}
    nbytes.update({name: (5 if "two" in name else 4) * n for name in parts if name.startswith("bwd kernel")})
    run_case(f"parts of the step, {rows}x{HIDDEN}", nbytes, parts, timer, copy_gbps)


def main() -> None:
    global LIB
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true", help="build build/quick_rms/ here, then stop")
    ap.add_argument("--rows", default="128,4096,32768", help="forward cases (comma-separated row counts)")
    ap.add_argument("--no-backward", action="store_true", help="forward cases only")
    ap.add_argument("--rounds", type=int, default=2, help="turns over the implementations of a case")
    ap.add_argument("--ncu", action="store_true", help="launch each forward variant once at --rows, time nothing")
    args = ap.parse_args()
    if args.build:
        build()
        return
    global NCU, ROUNDS
    NCU, ROUNDS = args.ncu, args.rounds
    t0 = time.perf_counter()
    LIB = load()
    # The module (`import ... as` would give the function of that name that the package re-exports).
    mod = importlib.import_module("opbuilder.ops.fused_add_rmsnorm")
    p = torch.cuda.get_device_properties(0)
    results["env"] = dict(torch=torch.__version__, cuda=torch.version.cuda, gpu=p.name, sms=p.multi_processor_count)
    results["info"] = {"fwd " + n: info(0, v) for v, n in enumerate(FWD)}
    results["info"].update({"bwd " + n: info(1, v) for v, n in enumerate(BWD)})
    print(results["env"], json.dumps(results["info"]), flush=True)
    timer = timing.CudaTimer(torch.device("cuda"))
    if NCU:
        for n in map(int, args.rows.split(",")):
            forward_case(n, timer, 1.0, mod.fused_add_rmsnorm)
        return
    copy = timing.copy_bandwidth(timer)
    results["copy"] = copy
    print(f"device-to-device copy: {copy['GBps']:.0f} GB/s ({copy['bytes']} B)", flush=True)
    run_case("empty kernel <<<1, 32>>>", None, {"empty": (lambda i: LIB.q_empty(1, 32, stream()), None)}, timer,
             copy["GBps"])
    stages = [(f"forward {n}", lambda n=n: forward_case(n, timer, copy["GBps"], mod.fused_add_rmsnorm))
              for n in map(int, args.rows.split(","))]
    if not args.no_backward:
        stages.append(("backward", lambda: backward_case(timer, copy["GBps"], mod)))
    for label, fn in stages:
        try:
            fn()
        except Exception:  # noqa: BLE001 - one failed case must not lose the others' numbers
            print(f"STAGE FAILED: {label}\n{traceback.format_exc()}", flush=True)
        torch.cuda.empty_cache()
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    failed = [c["name"] for c in results["checks"] if not c["ok"]]
    print(f"checks: {len(results['checks']) - len(failed)} passed, {len(failed)} failed {failed}", flush=True)
    save()


if __name__ == "__main__":
    main()
