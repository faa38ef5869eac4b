"""Forward-pass tuning of relu (fp32) and fused_add_rmsnorm (bf16): kernel variants side by side, in one run.

Variants are compile-time instantiations of the kernel templates in kernels/relu/relu_kernel.cuh and
kernels/fused_add_rmsnorm/fused_add_rmsnorm_kernel.cuh, launched with explicit configs through a small shared
library built from TUNE_CU below (no torch headers; called through ctypes with raw pointers). "orig (HEAD)"
is the committed launcher and kernels (git HEAD), copied into build/tune/orig/ with only their namespace renamed.

Every variant is checked first (fresh random inputs, outputs poisoned with NaN beforehand, odd sizes), then
timed with opbuilder's own CUDA timer (opbuilder/dispatch/timing.py: a sleep kernel hides the host's launch
time, CUDA events around one call, warm-up, median), on input sets rotated beyond 4x the L2, in two rounds
(the spread between rounds is the noise), beside torch eager, torch.compile and a device-to-device copy.
benchmarks/NOTES.md has the results of each run.

Run (repository root):
  python3 benchmarks/tuning/tune_fwd.py --prepare     here, with git and nvcc: writes and builds build/tune/
  OUT=folder python3 benchmarks/tuning/tune_fwd.py    on the GPU machine (carry build/tune); rebuilds there with nvcc
                                               if the carried libtune.so does not load
Writes $OUT/tune_fwd.json and prints a table per case; the last lines are the summary.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tuning import NVCC_FLAGS, timing

ROOT = Path(__file__).resolve().parents[2]
TUNE_DIR = ROOT / "build" / "tune"
LIB_PATH = TUNE_DIR / "libtune.so"
# The committed launchers and kernels that "orig (HEAD)" runs: (file under kernels/, namespace renamed to).
ORIG_FILES = {
    "relu/relu_kernel.cuh": "orig_relu", "relu/relu.cu": "orig_relu", "relu/relu.cuh": "orig_relu",
    "fused_add_rmsnorm/fused_add_rmsnorm_kernel.cuh": "orig_rms", "fused_add_rmsnorm/fused_add_rmsnorm.cu": "orig_rms",
    "fused_add_rmsnorm/fused_add_rmsnorm.cuh": "orig_rms", "fused_add_rmsnorm/fused_add_rmsnorm_plan.cuh": "orig_rms",
}
OUT = Path(os.environ.get("OUT", "/tmp"))
EPS = 1e-6
ROTATE_CACHE_MULTIPLE = 4
MAX_SETS = 256
c_void_p, c_int, c_int64, c_double = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double


results: dict = {"env": {}, "checks": [], "kernels": [], "times": []}


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tune_fwd.json").write_text(json.dumps(results, indent=1))


# ---- the library -------------------------------------------------------------------------------------


def build_lib() -> None:
    """nvcc build/tune/tune.cu -> build/tune/libtune.so (the compiler's resource report: build/tune/ptxas.log)."""
    t0 = time.perf_counter()
    with open(TUNE_DIR / "ptxas.log", "w") as log:
        subprocess.run(["nvcc", *NVCC_FLAGS, str(TUNE_DIR / "tune.cu"), "-o", str(LIB_PATH)], cwd=ROOT, check=True,
                       stderr=log)
    print(f"built {LIB_PATH.relative_to(ROOT)} in {time.perf_counter() - t0:.1f} s", flush=True)


def prepare() -> None:
    """Writes build/tune/ (orig/ from git HEAD, tune.cu) and builds the library."""
    (TUNE_DIR / "orig").mkdir(parents=True, exist_ok=True)
    for rel, ns in ORIG_FILES.items():
        text = subprocess.run(["git", "show", f"HEAD:kernels/{rel}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        ours = "opb::relu" if ns == "orig_relu" else "opb::fused_add_rmsnorm"
        (TUNE_DIR / "orig" / Path(rel).name).write_text(text.replace(f"namespace {ours}", f"namespace opb::{ns}"))
    (TUNE_DIR / "tune.cu").write_text(TUNE_CU)
    build_lib()


def load_lib() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(LIB_PATH))
        lib.tune_sms()
    except OSError as e:
        print(f"libtune.so did not load ({e}); building it here", flush=True)
        build_lib()
        lib = ctypes.CDLL(str(LIB_PATH))
    lib.tune_sms.restype = c_int
    lib.tune_kernel_info.argtypes = [c_void_p, c_int, ctypes.POINTER(c_int), ctypes.POINTER(c_int), ctypes.POINTER(c_int)]
    lib.tune_relu_fn.restype = c_void_p
    lib.tune_relu_fn.argtypes = [c_int, c_int, c_int, c_int]
    lib.tune_rms_fn.restype = c_void_p
    lib.tune_rms_fn.argtypes = [c_int, c_int, c_int, c_int]
    lib.tune_relu_orig.argtypes = [c_void_p, c_void_p, c_int64, c_int, c_void_p]
    lib.tune_relu_variant.argtypes = [c_void_p, c_int, c_int, c_int64, c_void_p, c_void_p, c_int64, c_void_p]
    lib.tune_rms_orig.argtypes = [c_void_p] * 5 + [c_int64, c_int64, c_double, c_int, c_void_p]
    lib.tune_rms_variant.argtypes = [c_void_p, c_int, c_int, c_int64] + [c_void_p] * 5 + [c_int64, c_int64, c_double, c_int, c_void_p]
    return lib


LIB: ctypes.CDLL | None = None
SMS = 0


def ok(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: CUDA error {code}")


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def dcode(dtype: torch.dtype) -> int:
    return {torch.float32: 0, torch.bfloat16: 1}[dtype]


def kernel_info(fn: int, threads: int) -> dict:
    regs, local, occ = c_int(), c_int(), c_int()
    ok(LIB.tune_kernel_info(fn, threads, ctypes.byref(regs), ctypes.byref(local), ctypes.byref(occ)), "kernel_info")
    return {"regs": regs.value, "local_bytes": local.value, "blocks_per_sm": occ.value}


# ---- variants ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReluVariant:
    threads: int
    unroll: int
    stream: bool  # __ldcs/__stcs
    persistent: bool  # grid = SMs x resident blocks, grid-stride loop

    @property
    def name(self) -> str:
        return f"t{self.threads} u{self.unroll} {'cs' if self.stream else 'plain'} {'persist' if self.persistent else 'cover'}"

    def fn(self, dtype: torch.dtype) -> int:
        fn = LIB.tune_relu_fn(dcode(dtype), self.threads, self.unroll, int(self.stream))
        if not fn:
            raise RuntimeError(f"no relu kernel for {self}")
        return fn

    def launcher(self, dtype: torch.dtype):
        fn = self.fn(dtype)
        per = 16 // torch.empty((), dtype=dtype).element_size()
        grid = SMS * kernel_info(fn, self.threads)["blocks_per_sm"] if self.persistent else 0

        def run(x: torch.Tensor, y: torch.Tensor) -> None:
            ok(LIB.tune_relu_variant(fn, self.threads, self.unroll, grid, x.data_ptr(), y.data_ptr(), x.numel() // per,
                                     stream()), self.name)

        return run


def relu_orig(dtype: torch.dtype):
    def run(x: torch.Tensor, y: torch.Tensor) -> None:
        ok(LIB.tune_relu_orig(x.data_ptr(), y.data_ptr(), x.numel(), dcode(dtype), stream()), "relu orig")

    return run


@dataclass(frozen=True)
class RmsVariant:
    nv: int  # 16-byte packs a thread
    w_early: bool  # weight loaded with the row (before the reduction)
    stream: bool  # __ldcs loads of input/residual
    tpr: int | None = None  # threads a row (one row a block when > 32); None: from the plan below (any hidden)
    label: str = ""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        shape = f"nv{self.nv} tpr{self.tpr}" if self.tpr else f"nv{self.nv}"
        return f"rows {shape} {'wearly' if self.w_early else 'wlate'} {'cs' if self.stream else 'plain'}"

    def config(self, hidden: int, dtype: torch.dtype) -> tuple[int, int, int]:
        """(nv, tpr, threads) for this hidden size."""
        pack = 16 // torch.empty((), dtype=dtype).element_size()
        nvec = hidden // pack
        if self.tpr is not None:
            assert self.nv * self.tpr >= nvec and self.tpr % 32 == 0, (self, hidden)
            return self.nv, self.tpr, self.tpr
        return rows_plan(nvec)

    def launcher(self, hidden: int, dtype: torch.dtype):
        nv, tpr, threads = self.config(hidden, dtype)
        fn = LIB.tune_rms_fn(dcode(dtype), nv, int(self.w_early), int(self.stream))
        if not fn:
            raise RuntimeError(f"no rms kernel for {self}")
        pack = 16 // torch.empty((), dtype=dtype).element_size()

        def run(x, r, w, out, rout) -> None:
            rows = x.numel() // hidden
            ok(LIB.tune_rms_variant(fn, tpr, threads, 0, x.data_ptr(), r.data_ptr() if r is not None else None,
                                    w.data_ptr(), out.data_ptr(), rout.data_ptr() if rout is not None else None,
                                    rows, hidden, EPS, pack, stream()), self.name)

        run.info = dict(nv=nv, tpr=tpr, threads=threads, **kernel_info(fn, threads))
        return run


def next_pow2(v: int) -> int:
    p = 1
    while p < v:
        p <<= 1
    return p


def rows_plan(nvec: int, max_nv: int = 8) -> tuple[int, int, int]:
    """kernels/fused_add_rmsnorm/fused_add_rmsnorm_plan.cuh's rows_plan (forward: 8 packs, 512 threads, 256)."""
    if nvec <= 32:
        return 1, next_pow2(nvec), 256
    if nvec <= 32 * max_nv:
        return next_pow2(math.ceil(nvec / 32)), 32, 128
    nv = min(next_pow2(math.ceil(nvec / 128)), max_nv)
    tpr = math.ceil(math.ceil(nvec / nv) / 32) * 32
    assert tpr <= 512
    return nv, tpr, tpr


def rms_orig(hidden: int, dtype: torch.dtype):
    def run(x, r, w, out, rout) -> None:
        rows = x.numel() // hidden
        ok(LIB.tune_rms_orig(x.data_ptr(), r.data_ptr() if r is not None else None, w.data_ptr(), out.data_ptr(),
                             rout.data_ptr() if rout is not None else None, rows, hidden, EPS, dcode(dtype), stream()),
           "rms orig")

    run.info = {}
    return run


# hidden 4096 bf16: 512 packs a row, nv x tpr = 512, one row a block. Run 1 also timed several rows of
# > 32 threads a block and a persistent kernel; both lost and their code is gone (benchmarks/NOTES.md).
RMS_VARIANTS_4096 = [
    RmsVariant(4, False, True, 128),  # the plan's shape, as HEAD had it for every size
    RmsVariant(4, True, True, 128),
    RmsVariant(4, False, False, 128),
    RmsVariant(4, True, False, 128),
    RmsVariant(2, False, True, 256),
    RmsVariant(2, True, True, 256),
    RmsVariant(2, True, False, 256),
    RmsVariant(1, False, True, 512),
    RmsVariant(1, True, True, 512),
    RmsVariant(1, False, False, 512),
    RmsVariant(1, True, False, 512),  # the launcher's choice for 512 packs since run 1
    RmsVariant(8, False, True, 64),
]

# Any hidden size, by the plan's shapes (rows_plan below).
RMS_POLICIES = [
    RmsVariant(0, True, True, label="plan rows wearly cs"),
    RmsVariant(0, True, False, label="plan rows wearly plain"),
    RmsVariant(0, False, False, label="plan rows wlate plain"),
]


def policy_launcher(p: RmsVariant, hidden: int, dtype: torch.dtype):
    pack = 16 // torch.empty((), dtype=dtype).element_size()
    nv, tpr, threads = rows_plan(hidden // pack)
    w_early = p.w_early and nv <= 4  # NV8 + W_EARLY spills
    if tpr > 32:
        return RmsVariant(nv, w_early, p.stream, tpr).launcher(hidden, dtype)
    fn = LIB.tune_rms_fn(dcode(dtype), nv, int(w_early), int(p.stream))

    def run(x, r, w, out, rout) -> None:  # several rows a block (tpr <= 32)
        ok(LIB.tune_rms_variant(fn, tpr, threads, 0, x.data_ptr(), r.data_ptr() if r is not None else None,
                                w.data_ptr(), out.data_ptr(), rout.data_ptr() if rout is not None else None,
                                x.numel() // hidden, hidden, EPS, pack, stream()), p.name)

    run.info = dict(nv=nv, tpr=tpr, threads=threads, **kernel_info(fn, threads))
    return run


# ---- checks ------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_relu(name: str, make, dtype: torch.dtype, n: int) -> bool:
    run = make(dtype)
    x = torch.randn(n, device="cuda", dtype=torch.float32).to(dtype)
    x[:: max(1, n // 7)] = float("nan")
    y = torch.full_like(x, float("nan"))
    y[1::2] = 123.0
    run(x, y)
    torch.cuda.synchronize()
    ref = torch.relu(x)
    good = bool(torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(y.nan_to_num(7.0), ref.nan_to_num(7.0)))
    results["checks"].append(dict(op="relu", variant=name, dtype=str(dtype), n=n, ok=good))
    if not good:
        print(f"CHECK FAILED relu {name} {dtype} n={n}", flush=True)
    return good


def ref_rms(x, r, w):
    h = (x + r) if r is not None else x  # rounded to the dtype, as the op defines it
    hf = h.double()
    out = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    return out, h


def check_rms(name: str, run, rows: int, hidden: int, dtype: torch.dtype, with_res: bool) -> bool:
    x = torch.randn(rows, hidden, device="cuda").to(dtype)
    r = torch.randn(rows, hidden, device="cuda").to(dtype) if with_res else None
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    out = torch.full_like(x, float("nan"))
    rout = torch.full_like(x, float("nan")) if with_res else None
    run(x, r, w, out, rout)
    torch.cuda.synchronize()
    ref_out, ref_h = ref_rms(x, r, w)
    err = rel_err(out, ref_out)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    good = bool(torch.isfinite(out).all()) and err < tol
    if with_res:
        good = good and bool(torch.equal(rout, ref_h))
    results["checks"].append(dict(op="fused_add_rmsnorm", variant=name, dtype=str(dtype), rows=rows, hidden=hidden,
                                  residual=with_res, rel_err=err, ok=good))
    if not good:
        print(f"CHECK FAILED rms {name} {dtype} {rows}x{hidden} res={with_res} rel_err={err:.2e}", flush=True)
    return good


# ---- timing ------------------------------------------------------------------------------------------


def set_count(footprint: int, timer) -> int:
    wanted = math.ceil(ROTATE_CACHE_MULTIPLE * timer.cache_bytes() / footprint)
    return max(1, min(wanted, MAX_SETS, timer.spare_bytes() // footprint))


def measure_rounds(timer, impls: dict, rounds: int) -> dict:
    """impls: name -> (step, reset or None). Each round times every impl once, in turn."""
    per: dict[str, list] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, step in impls.items():
            per[name].append(timer.measure(step))
    return per


def report(case: str, nbytes: int, per: dict, copy_gbps: float, infos: dict, base: str) -> list[dict]:
    rows = []
    base_us = statistics.median(x for t in per[base] for x in t.samples_us)
    print(f"\n== {case}  ({nbytes} B; copy {copy_gbps:.0f} GB/s -> floor {nbytes / copy_gbps / 1e3:.1f} us)", flush=True)
    print(f"{'impl':36s} {'median us':>9s} {'round1':>8s} {'round2':>8s} {'spread':>7s} {'of copy':>7s} {'vs ' + base:>9s}  info")
    for name, parts in per.items():
        pooled = timing.Timing.pooled(parts)
        med = statistics.median(pooled.samples_us)
        rmeds = [statistics.median(p.samples_us) for p in parts]
        spread = max(rmeds) - min(rmeds)
        frac = nbytes / med / 1e3 / copy_gbps
        info = infos.get(name, {})
        row = dict(case=case, impl=name, us=med, rounds_us=rmeds, spread_us=spread, frac_copy=frac,
                   speedup_vs_base=base_us / med, repeats=len(pooled.samples_us), host_us=pooled.host_us, **info)
        rows.append(row)
        results["times"].append(row)
        r2 = f"{rmeds[1]:8.2f}" if len(rmeds) > 1 else " " * 8
        inf = " ".join(f"{k}={v}" for k, v in info.items())
        print(f"{name:36s} {med:9.2f} {rmeds[0]:8.2f} {r2} {spread:7.2f} {frac:7.3f} {base_us / med:9.3f}  {inf}", flush=True)
    save()
    return rows


def relu_case(timer, copy_gbps: float, rounds: int, quick: bool) -> list[dict]:
    dtype = torch.float32
    shape = (32768, 8192)
    n = shape[0] * shape[1]
    variants = [ReluVariant(t, u, s, p) for s in (True, False) for t in (128, 256, 512) for u in (2, 4, 8)
                for p in (False, True)]
    if quick:
        variants = variants[:4]
    makers = {"orig (HEAD)": relu_orig}
    makers.update({v.name: v.launcher for v in variants})
    good = {}
    for name, make in makers.items():
        good[name] = all(check_relu(name, make, dt, k * 16 // torch.empty((), dtype=dt).element_size())
                         for dt in (torch.float32, torch.bfloat16) for k in (1_000_003, 64, 5 * 4096 + 1))
        good[name] = good[name] and check_relu(name, make, dtype, n)
    infos = {}
    for v in variants:
        fn = v.fn(dtype)
        infos[v.name] = kernel_info(fn, v.threads)
    x = torch.randn(n, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    footprint = 2 * x.nbytes
    assert set_count(footprint, timer) == 1
    impls = {}
    for name, make in makers.items():
        if not good[name]:
            continue
        run = make(dtype)
        impls[name] = lambda i, run=run: run(x, y)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: torch.relu(t), dynamic=False)
    impls["torch eager relu"] = lambda i: torch.relu(x)
    impls["torch.compile relu"] = lambda i: compiled(x)
    t0 = time.perf_counter()
    compiled(x)
    torch.cuda.synchronize()
    print(f"relu torch.compile first call {time.perf_counter() - t0:.1f} s", flush=True)
    per = measure_rounds(timer, impls, rounds)
    return report(f"relu fp32 {shape[0]}x{shape[1]}", 2 * x.nbytes, per, copy_gbps, infos, "orig (HEAD)")


def eager_add_rmsnorm(inp, residual, weight):
    """opbuilder bench's eager reference: the sum in the input's dtype, the norm in float32."""
    h = inp + residual
    hf = h.float()
    out = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return out.to(inp.dtype), h


def rms_case(timer, copy_gbps: float, rounds: int, rows: int, hidden: int, launchers: dict, with_torch: bool) -> list[dict]:
    dtype = torch.bfloat16
    footprint = (4 * rows * hidden + hidden) * 2
    count = set_count(footprint, timer)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(rows * 7 + hidden)
    w = torch.randn(hidden, device="cuda", generator=gen).to(dtype)
    sets = []
    for _ in range(count):
        x = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
        r = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
        sets.append((x, r, torch.empty_like(x), torch.empty_like(x)))
    impls, infos = {}, {}
    for name, run in launchers.items():
        impls[name] = lambda i, run=run: run(sets[i % count][0], sets[i % count][1], w, sets[i % count][2], sets[i % count][3])
        infos[name] = run.info
    if with_torch:
        torch._dynamo.reset()
        compiled = torch.compile(eager_add_rmsnorm, dynamic=False)
        t0 = time.perf_counter()
        compiled(sets[0][0], sets[0][1], w)
        torch.cuda.synchronize()
        print(f"rms torch.compile {rows}x{hidden} first call {time.perf_counter() - t0:.1f} s", flush=True)
        impls["torch eager (fp32 norm)"] = lambda i: eager_add_rmsnorm(sets[i % count][0], sets[i % count][1], w)
        impls["torch.compile"] = lambda i: compiled(sets[i % count][0], sets[i % count][1], w)
    per = measure_rounds(timer, impls, rounds)
    rows_out = report(f"fused_add_rmsnorm bf16 {rows}x{hidden} ({count} sets)", footprint, per, copy_gbps, infos,
                      "orig (HEAD)")
    sets.clear()  # free the inputs (the closures above hold the list)
    torch.cuda.empty_cache()
    return rows_out


def rms_checks(name: str, run_for) -> bool:
    """run_for(hidden, dtype) -> launcher. Odd row counts (partly filled blocks and grid strides), no residual."""
    good = True
    for rows, hidden, dtype, res in ((4096, 4096, torch.bfloat16, True), (1003, 4096, torch.bfloat16, True),
                                     (129, 4096, torch.bfloat16, False), (1003, 2048, torch.float32, True),
                                     (7, 2048, torch.float32, False)):
        try:
            good = check_rms(name, run_for(hidden, dtype), rows, hidden, dtype, res) and good
        except (RuntimeError, AssertionError) as e:
            print(f"CHECK FAILED rms {name} {dtype} {rows}x{hidden}: {e}", flush=True)
            results["checks"].append(dict(op="fused_add_rmsnorm", variant=name, rows=rows, hidden=hidden, ok=False))
            good = False
    return good


def main() -> None:
    global LIB, SMS
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="few variants, one round (a smoke test)")
    ap.add_argument("--prepare", action="store_true", help="write and build build/tune/ here, then stop")
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    rounds = 1 if args.quick else 2
    t_start = time.perf_counter()
    LIB = load_lib()
    SMS = LIB.tune_sms()
    p = torch.cuda.get_device_properties(0)
    results["env"] = dict(torch=torch.__version__, cuda=torch.version.cuda, gpu=p.name, sms=p.multi_processor_count,
                          l2=getattr(p, "L2_cache_size", None), python=sys.version.split()[0])
    print(results["env"], flush=True)
    timer = timing.CudaTimer(torch.device("cuda"), budget_ms=100, warmup_ms=20)
    copy = timing.copy_bandwidth(timer)
    copy2 = timing.copy_bandwidth(timer)
    results["copy"] = [copy, copy2]
    copy_gbps = (copy["GBps"] + copy2["GBps"]) / 2
    print(f"device-to-device copy: {copy['GBps']:.0f} and {copy2['GBps']:.0f} GB/s ({copy['bytes']} B)", flush=True)
    save()

    summary = []

    def stage(label, fn):
        """One case; a failure is printed and the run goes on to the next case."""
        try:
            summary.append((label, fn()))
        except Exception:  # noqa: BLE001 - one failed case must not lose the others' numbers
            import traceback

            print(f"STAGE FAILED: {label}\n{traceback.format_exc()}", flush=True)
        print(f"[{time.perf_counter() - t_start:.0f} s]", flush=True)

    # ---- relu
    stage("relu", lambda: relu_case(timer, copy_gbps, rounds, args.quick))

    # ---- fused_add_rmsnorm, hidden 4096: every variant, checked first
    launchers = {"orig (HEAD)": rms_orig(4096, torch.bfloat16)}
    good = {"orig (HEAD)": rms_checks("orig (HEAD)", lambda h, dt: rms_orig(h, dt))}
    variants = RMS_VARIANTS_4096[:3] if args.quick else RMS_VARIANTS_4096
    for v in variants:
        # The checks' shapes (bf16 4096, fp32 2048) are both 512 packs a row: the same config fits both.
        good[v.name] = rms_checks(v.name, lambda h, dt, v=v: v.launcher(h, dt))
        if good[v.name]:
            launchers[v.name] = v.launcher(4096, torch.bfloat16)
    print(f"rms checks done [{time.perf_counter() - t_start:.0f} s]", flush=True)
    for pol in RMS_POLICIES:
        good[pol.name] = rms_checks(pol.name, lambda h, dt, pol=pol: policy_launcher(pol, h, dt))
    save()
    for rows in (32768, 4096, 128):
        stage(f"rms {rows}", lambda rows=rows: rms_case(timer, copy_gbps, rounds, rows, 4096, launchers, True))

    # ---- other hidden sizes (256 MiB moved), by policy
    if not args.quick:
        for hidden in (1024, 2048, 8192, 16384):
            rows = (32 * 1024 * 1024) // hidden

            def policy_case(rows=rows, hidden=hidden):
                pl = {"orig (HEAD)": rms_orig(hidden, torch.bfloat16)}
                for pol in RMS_POLICIES:
                    if good[pol.name]:
                        pl[pol.name] = policy_launcher(pol, hidden, torch.bfloat16)
                return rms_case(timer, copy_gbps, rounds, rows, hidden, pl, False)

            stage(f"rms {rows}x{hidden}", policy_case)

    # ---- summary: the best variant of each case against orig, with the spreads
    print("\n== summary: fastest checked variant per case vs orig (spread = |round1 - round2|)")
    for case, rows in summary:
        base = next(r for r in rows if r["impl"] == "orig (HEAD)")
        cands = [r for r in rows if not r["impl"].startswith("torch") and r["impl"] != "orig (HEAD)"]
        best = min(cands, key=lambda r: r["us"])
        torch_rows = {r["impl"]: r["us"] for r in rows if r["impl"].startswith("torch")}
        gain = base["us"] - best["us"]
        noise = max(base["spread_us"], best["spread_us"])
        print(f"{case:14s} orig {base['us']:8.2f} us ({base['frac_copy']:.3f})  best {best['impl']:32s} {best['us']:8.2f} us "
              f"({best['frac_copy']:.3f})  gain {gain:6.2f} us  noise {noise:5.2f}  "
              + " ".join(f"{k} {v:.2f}" for k, v in torch_rows.items()), flush=True)
    failed = [c for c in results["checks"] if not c["ok"]]
    print(f"checks: {len(results['checks']) - len(failed)} passed, {len(failed)} failed; "
          f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    save()


TUNE_CU = r'''// Tuning-only entry points for benchmarks/tuning/tune_fwd.py (not part of the op; not committed).
// "orig" = the committed launchers and kernels (git HEAD), copied verbatim into build/tune/orig/ with only
// their namespace renamed; "variant" = the working tree's kernel templates, launched with explicit configs.
// Built as a plain shared library (no torch headers) and called through ctypes with raw pointers.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "orig/relu.cuh"
#include "orig/relu_kernel.cuh"
#include "orig/relu.cu"
#include "orig/fused_add_rmsnorm.cuh"
#include "orig/fused_add_rmsnorm.cu"

#include "relu/relu_kernel.cuh"
#include "fused_add_rmsnorm/fused_add_rmsnorm_kernel.cuh"

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

int sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

// ---- relu ------------------------------------------------------------------------------------------
// index: ((dtype * 3 + threads_i) * 3 + unroll_i) * 2 + stream;  dtype 0 = fp32, 1 = bf16
using ReluFn = void (*)(const uint4*, uint4*, int64_t);

template <typename T, int TH, int U, bool S>
const void* relu_fn() {
  return reinterpret_cast<const void*>(&opb::relu::relu_vec_kernel<T, TH, U, S>);
}

template <typename T, int TH, int U>
void fill_relu2(const void** t, int i) {
  t[i * 2 + 0] = relu_fn<T, TH, U, false>();
  t[i * 2 + 1] = relu_fn<T, TH, U, true>();
}
template <typename T, int TH>
void fill_relu1(const void** t, int i) {
  fill_relu2<T, TH, 2>(t, i * 3 + 0);
  fill_relu2<T, TH, 4>(t, i * 3 + 1);
  fill_relu2<T, TH, 8>(t, i * 3 + 2);
}
template <typename T>
void fill_relu0(const void** t, int d) {
  fill_relu1<T, 128>(t, d * 3 + 0);
  fill_relu1<T, 256>(t, d * 3 + 1);
  fill_relu1<T, 512>(t, d * 3 + 2);
}

const void** relu_table() {
  static const void* t[2 * 3 * 3 * 2] = {};
  static bool done = false;
  if (!done) {
    fill_relu0<float>(t, 0);
    fill_relu0<__nv_bfloat16>(t, 1);
    done = true;
  }
  return t;
}

int idx3(int v, int a, int b, int c) { return v == a ? 0 : v == b ? 1 : v == c ? 2 : -1; }

// ---- fused_add_rmsnorm -----------------------------------------------------------------------------
// The rows kernel: nv in {1, 2, 4, 8} packs a thread, w_early, stream. dtype 0 fp32, 1 bf16.
template <typename T, int NV>
const void* rms_fn(int w_early, int stream) {
  using namespace opb::fused_add_rmsnorm;
  if (w_early) {
    return stream ? reinterpret_cast<const void*>(&forward_rows_kernel<T, NV, true, true>)
                  : reinterpret_cast<const void*>(&forward_rows_kernel<T, NV, true, false>);
  }
  return stream ? reinterpret_cast<const void*>(&forward_rows_kernel<T, NV, false, true>)
                : reinterpret_cast<const void*>(&forward_rows_kernel<T, NV, false, false>);
}

template <typename T>
const void* rms_fn_t(int nv, int w_early, int stream) {
  switch (nv) {
    case 1: return rms_fn<T, 1>(w_early, stream);
    case 2: return rms_fn<T, 2>(w_early, stream);
    case 4: return rms_fn<T, 4>(w_early, stream);
    case 8: return rms_fn<T, 8>(w_early, stream);
  }
  return nullptr;
}

}  // namespace

EXPORT int tune_sms() { return sms(); }

// Registers, local (stack) bytes and resident blocks per SM of a kernel at `threads` threads.
EXPORT int tune_kernel_info(const void* fn, int threads, int* regs, int* local_bytes, int* blocks_per_sm) {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, fn);
  if (e != cudaSuccess) return e;
  *regs = a.numRegs;
  *local_bytes = static_cast<int>(a.localSizeBytes);
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, fn, threads, 0);
}

EXPORT const void* tune_relu_fn(int dtype, int threads, int unroll, int stream) {
  const int ti = idx3(threads, 128, 256, 512), ui = idx3(unroll, 2, 4, 8);
  if (ti < 0 || ui < 0 || dtype < 0 || dtype > 1) return nullptr;
  return relu_table()[((dtype * 3 + ti) * 3 + ui) * 2 + (stream ? 1 : 0)];
}

EXPORT const void* tune_rms_fn(int dtype, int nv, int w_early, int stream) {
  return dtype == 0 ? rms_fn_t<float>(nv, w_early, stream) : rms_fn_t<__nv_bfloat16>(nv, w_early, stream);
}

// dtype: 0 fp32, 1 bf16 (as opb::DType's Float32 / BFloat16).
EXPORT int tune_relu_orig(const void* x, void* y, int64_t n, int dtype, void* stream) {
  return opb::orig_relu::launch(x, y, n, dtype == 0 ? opb::DType::Float32 : opb::DType::BFloat16,
                                static_cast<cudaStream_t>(stream));
}

// grid_blocks: 0 = one chunk per block (covers the tensor); > 0 = that many blocks (grid-stride loop).
// n must be a multiple of the vector width (the tail path is the same in every variant).
EXPORT int tune_relu_variant(const void* fn, int threads, int unroll, int64_t grid_blocks, const void* x, void* y,
                             int64_t n_vec, void* stream) {
  if (fn == nullptr) return cudaErrorInvalidValue;
  int64_t blocks = grid_blocks > 0 ? grid_blocks : (n_vec + int64_t(threads) * unroll - 1) / (int64_t(threads) * unroll);
  const uint4* xp = static_cast<const uint4*>(x);
  uint4* yp = static_cast<uint4*>(y);
  void* args[] = {&xp, &yp, &n_vec};
  cudaError_t e = cudaLaunchKernel(fn, dim3(static_cast<unsigned>(blocks)), dim3(threads), args, 0,
                                   static_cast<cudaStream_t>(stream));
  return e != cudaSuccess ? e : cudaGetLastError();
}

EXPORT int tune_rms_orig(const void* input, const void* residual, const void* weight, void* out, void* residual_out,
                         int64_t rows, int64_t hidden, double eps, int dtype, void* stream) {
  return opb::orig_rms::launch_forward(input, residual, weight, out, residual_out, rows, hidden, eps,
                                       dtype == 0 ? opb::DType::Float32 : opb::DType::BFloat16,
                                       static_cast<cudaStream_t>(stream));
}

// An explicit config: tpr threads a row (a power of two <= 32: threads a multiple of tpr; or a multiple of
// 32: threads == tpr, one row a block), grid blocks (0 = enough to cover the rows once).
EXPORT int tune_rms_variant(const void* fn, int tpr, int threads, int64_t grid_blocks, const void* input,
                            const void* residual, const void* weight, void* out, void* residual_out, int64_t rows,
                            int64_t hidden, double eps, int pack, void* stream) {
  if (fn == nullptr || hidden % pack != 0 || threads % tpr != 0 || (tpr > 32 && threads != tpr)) {
    return cudaErrorInvalidValue;
  }
  const int rpb = threads / tpr;
  int64_t blocks = (rows + rpb - 1) / rpb;
  if (grid_blocks > 0 && grid_blocks < blocks) blocks = grid_blocks;
  int nvec = static_cast<int>(hidden / pack);
  float inv_hidden = 1.f / static_cast<float>(hidden);
  float feps = static_cast<float>(eps);
  void* args[] = {&input, &residual, &weight, &out, &residual_out, &rows, &nvec, &tpr, &inv_hidden, &feps};
  cudaError_t e = cudaLaunchKernel(fn, dim3(static_cast<unsigned>(blocks)), dim3(threads), args, 0,
                                   static_cast<cudaStream_t>(stream));
  return e != cudaSuccess ? e : cudaGetLastError();
}
'''


if __name__ == "__main__":
    main()
