"""The cases where the ops lost to a peer (issue 14's four), on the GPU, in one run: the op as built, kernel variants (launch shape, cache
policy, one or two exps an element), Liger-Kernel, torch.compile and the floors, each checked first.

Cases (H100 targets of issue 14):
* softmax forward fp32 4096 x 4096: faster than Liger.
* softmax forward + backward bf16 32768 x 4096: faster than Liger (the op's autograd step as
  `opbuilder bench` times it, and steps built from a forward and a backward variant).
* add+RMSNorm forward bf16 4096 x 4096 and 128 x 4096: at least as fast as torch.compile.
* matmul+add+ReLU forward + backward, 1 x 4096^3 and 8 x 2048^3 (bias of the output's shape): at most 1.08x
  its floor, the three GEMMs as the op's backward issues them plus one pass over the gradient (the mask),
  timed as one step on the same inputs.
* the other softmax shapes of the bench (bf16 4096 x 4096, fp32/bf16 16384 x 32768), for the variants a
  change would reach there too.

Every variant is checked on fresh random inputs against a float64 reference, into a NaN-poisoned output,
before it is timed. Timing: opbuilder's own CUDA timer (opbuilder/dispatch/timing.py: a sleep kernel hides the
host, events around each call, median of the repeats), input sets rotated beyond 4x the L2 as the bench does,
outputs allocated per call as the ops do, two rounds taken in turns (the spread between them is the noise).
Some cases are also timed with triton's do_bench (an L2 flush before each call; column "flush").

  python3 benchmarks/tuning/peer_cases.py --build      here: nvcc -> build/peer_cases/libpeer_cases.so
  python3 benchmarks/tuning/peer_cases.py --build-sweep REV   here: softmax's launchers of git REV and of the working
                                                    tree -> build/peer_cases/sweep_{base,new}.so
  OUT=dir python3 benchmarks/tuning/peer_cases.py      GPU machine (rebuilds the library if it does not load)
  OUT=dir python3 benchmarks/tuning/peer_cases.py --only sweep   softmax forward and backward with each tree's own
                                                    default plans, side by side over more shapes than the bench
Writes $OUT/peer_cases.json; prints a table per case and a summary last.
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
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SRC = Path(__file__).with_name("peer_cases_kernels.cu")
LIB_PATH = ROOT / "build" / "peer_cases" / "libpeer_cases.so"
OUT = Path(os.environ.get("OUT", "/tmp"))
if str(ROOT) not in sys.path:  # opbuilder from this checkout, whether or not it is installed
    sys.path.insert(0, str(ROOT))
from tuning import NVCC_FLAGS  # noqa: E402  (the op builder's own flags; tuning.py is beside this file)
NVCC = os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc")
EPS = 1e-6
BF16, FP32 = torch.bfloat16, torch.float32
TOL = {FP32: 1e-5, BF16: 1e-2}
ROTATE = 4  # input sets span this many L2s, as `opbuilder bench` rotates them
RESULTS: dict = {"cases": {}, "checks": [], "errors": []}


def log(*args: object) -> None:
    print(*args, flush=True)


# ---- the variant library -------------------------------------------------------------------------------


def build() -> None:
    LIB_PATH.parent.mkdir(parents=True, exist_ok=True)
    cmd = [NVCC, *NVCC_FLAGS, str(SRC), "-o", str(LIB_PATH)]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (LIB_PATH.parent / "ptxas.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"nvcc failed:\n{res.stderr[-4000:]}")
    log(f"built {LIB_PATH} in {time.time() - t0:.1f} s")


class Lib:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL(str(LIB_PATH))
            self.lib.q_count()
        except (OSError, AttributeError) as e:
            log(f"library does not load ({e}); building it")
            build()
            self.lib = ctypes.CDLL(str(LIB_PATH))
        L, i64, vp = self.lib, ctypes.c_int64, ctypes.c_void_p
        L.q_sm_fwd.argtypes = [ctypes.c_int, vp, vp, i64, i64, vp]
        L.q_sm_bwd.argtypes = [ctypes.c_int, vp, vp, vp, i64, i64, vp]
        L.q_rms_fwd.argtypes = [ctypes.c_int, vp, vp, vp, vp, vp, i64, vp]
        L.q_touch.argtypes = [vp, vp, vp, vp, vp, i64, vp]
        L.q_empty.argtypes = [ctypes.c_int, ctypes.c_int, vp]
        self.variants = []
        buf = ctypes.create_string_buffer(256)
        for i in range(L.q_count()):
            L.q_desc(i, buf, 256)
            family, dtype, name, threads, vpt = buf.value.decode().split("|")
            regs, local, occ = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            L.q_attr(i, ctypes.byref(regs), ctypes.byref(local), ctypes.byref(occ))
            self.variants.append({
                "index": i, "family": int(family), "dtype": (FP32, BF16)[int(dtype)], "name": name,
                "threads": int(threads), "vpt": int(vpt), "regs": regs.value, "local": local.value, "occ": occ.value,
            })

    def family(self, family: int, dtype: torch.dtype, cols: int) -> list[dict]:
        """The variants of a family that hold a row of `cols` elements with at most half of it idle."""
        vectors = cols * torch.finfo(dtype).bits // 128
        return [v for v in self.variants if v["family"] == family and v["dtype"] == dtype
                and vectors <= v["threads"] * v["vpt"] < 2 * vectors]

    @staticmethod
    def stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: launch returned {rc}")

    def sm_fwd(self, v: dict, x: torch.Tensor, y: torch.Tensor) -> None:
        self.check(self.lib.q_sm_fwd(v["index"], x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], self.stream()),
                   v["name"])

    def sm_bwd(self, v: dict, y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> None:
        self.check(self.lib.q_sm_bwd(v["index"], y.data_ptr(), dy.data_ptr(), dx.data_ptr(), y.shape[0], y.shape[1],
                                     self.stream()), v["name"])

    def rms_fwd(self, v: dict, x, r, w, out, rout) -> None:
        self.check(self.lib.q_rms_fwd(v["index"], x.data_ptr(), r.data_ptr(), w.data_ptr(), out.data_ptr(),
                                      rout.data_ptr(), x.shape[0], self.stream()), v["name"])


# ---- timing ----------------------------------------------------------------------------------------------


class Bench:
    def __init__(self) -> None:
        from opbuilder.dispatch.timing import CudaTimer, copy_bandwidth

        self.device = torch.device("cuda")
        self.timer = CudaTimer(self.device, budget_ms=120)
        self.timer.rounds = 2
        self.copy = copy_bandwidth(self.timer)
        self.l2 = self.timer.cache_bytes()
        log(f"{torch.cuda.get_device_name()}: copy {self.copy['GBps']:.0f} GB/s, L2 {self.l2 >> 20} MiB, "
            f"torch {torch.__version__}")
        RESULTS.update(device=torch.cuda.get_device_name(), copy_GBps=self.copy["GBps"], torch=torch.__version__)

    def sets(self, footprint: int) -> int:
        return max(1, min(64, math.ceil(ROTATE * self.l2 / footprint)))

    def time(self, case: str, impls: dict[str, tuple[Callable, Callable | None]], nbytes: int | None = None,
             flush: tuple[str, ...] = ()) -> list[dict]:
        """Every impl measured in turns, `rounds` times; rows with median, per-round medians and mean."""
        from opbuilder.dispatch.timing import Timing

        parts: dict[str, list] = {k: [] for k in impls}
        for _ in range(self.timer.rounds):
            for name, (step, reset) in list(impls.items()):
                try:
                    parts[name].append(self.timer.measure(step, reset))
                except Exception as e:  # one broken variant must not stop the run
                    RESULTS["errors"].append(f"{case} {name}: {type(e).__name__}: {e}")
                    log(f"  {name}: ERROR {type(e).__name__}: {e}")
                    impls.pop(name)
        rows = []
        for name in impls:
            pooled = Timing.pooled(parts[name])
            samples = pooled.samples_us
            row = {"impl": name, "us": statistics.median(samples), "mean_us": statistics.fmean(samples),
                   "rounds_us": [statistics.median(p.samples_us) for p in parts[name]], "repeats": len(samples)}
            if nbytes:
                row["of_copy"] = nbytes / row["us"] / 1e3 / self.copy["GBps"]
            if name in flush:
                row["flush_us"] = self.flush_time(*impls[name])
            rows.append(row)
        RESULTS["cases"][case] = rows
        self.print_case(case, rows)
        return rows

    @staticmethod
    def flush_time(step: Callable, reset: Callable | None) -> float:
        """triton's do_bench (an L2 flush before each call), median, us."""
        import triton.testing

        counter = iter(range(10**9))

        def call() -> None:
            i = next(counter)
            if reset:
                reset(i)
            step(i)

        return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3

    @staticmethod
    def print_case(case: str, rows: list[dict]) -> None:
        log(f"\n== {case}")
        for r in sorted(rows, key=lambda r: r["us"]):
            rounds = " / ".join(f"{u:.2f}" for u in r["rounds_us"])
            extra = f"  {r['of_copy']:.3f} of copy" if "of_copy" in r else ""
            extra += f"  flush {r['flush_us']:.2f}" if "flush_us" in r else ""
            log(f"  {r['impl']:<34} {r['us']:>9.2f} us (mean {r['mean_us']:.2f}; {rounds}){extra}")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    err = torch.linalg.vector_norm(got - want).item() / max(torch.linalg.vector_norm(want).item(), 1e-300)
    return err if math.isfinite(err) else float("inf")


def record_check(what: str, err: float, tol: float) -> bool:
    ok = err <= tol
    RESULTS["checks"].append({"what": what, "rel_err": err, "tol": tol, "ok": ok})
    if not ok:
        log(f"  CHECK FAILED {what}: rel err {err:.3g} > {tol:g}")
    return ok


def randn(shape, dtype, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda", generator=gen) * scale).to(dtype)


# ---- softmax ---------------------------------------------------------------------------------------------


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), -1)


def check_softmax_fwd(lib: Lib, v: dict, cols: int, dtype: torch.dtype, seed: int) -> bool:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = randn((67, cols), dtype, gen, 4.0)
    x[3] += 1000.0  # a row far from 0: the max must come off first
    y = torch.full_like(x, float("nan"))
    lib.sm_fwd(v, x, y)
    torch.cuda.synchronize()
    return record_check(f"softmax fwd {cols} {dtype} {v['name']}", rel_err(y, softmax_ref(x)), TOL[dtype])


def check_softmax_bwd(lib: Lib, v: dict, cols: int, dtype: torch.dtype, seed: int) -> bool:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.softmax(randn((67, cols), FP32, gen, 4.0), -1).to(dtype)
    dy = randn((67, cols), dtype, gen)
    dx = torch.full_like(y, float("nan"))
    lib.sm_bwd(v, y, dy, dx)
    torch.cuda.synchronize()
    y64, dy64 = y.double(), dy.double()
    ref = y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
    return record_check(f"softmax bwd {cols} {dtype} {v['name']}", rel_err(dx, ref), TOL[dtype])


def liger_softmax():
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction

        return LigerSoftmaxFunction.apply
    except Exception as e:
        RESULTS["errors"].append(f"liger softmax: {type(e).__name__}: {e}")
        log(f"liger softmax unavailable: {type(e).__name__}: {e}")
        return None


def softmax_forward_case(b: Bench, lib: Lib, rows: int, cols: int, dtype: torch.dtype, flush: bool) -> None:
    from opbuilder.ops.softmax import softmax

    case = f"softmax fwd {rows}x{cols} {str(dtype)[6:]}"
    nbytes = 2 * rows * cols * torch.finfo(dtype).bits // 8
    n = b.sets(nbytes)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [randn((rows, cols), dtype, gen, 4.0) for _ in range(n)]
    impls: dict[str, tuple[Callable, Callable | None]] = {}
    got = softmax(xs[0])
    if record_check(f"{case} op", rel_err(got, softmax_ref(xs[0])), TOL[dtype]):
        impls["op"] = (lambda i: softmax(xs[i % n]), None)
    liger = liger_softmax()
    if liger is not None:
        if record_check(f"{case} liger", rel_err(liger(xs[0]), softmax_ref(xs[0])), 2 * TOL[dtype]):
            impls["liger"] = (lambda i: liger(xs[i % n]), None)
    impls["torch.softmax"] = (lambda i: torch.softmax(xs[i % n], -1), None)
    dst = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    srcs = [x.view(torch.uint8).reshape(-1) for x in xs]
    impls["copy, same bytes"] = (lambda i: dst.copy_(srcs[i % n]), None)
    for k, v in enumerate(lib.family(0, dtype, cols)):
        if check_softmax_fwd(lib, v, cols, dtype, 100 + k):
            impls[v["name"]] = (lambda i, v=v: lib.sm_fwd(v, xs[i % n], torch.empty_like(xs[i % n])), None)
    names = ("op", "liger", "copy, same bytes", "256x4 nc/wb", "once 128x8 nc/cs", "once 128x8 nc/wb") if flush else ()
    b.time(case, impls, nbytes, flush=names)
    impls.clear()
    xs.clear()
    torch.cuda.empty_cache()


def softmax_step_case(b: Bench, lib: Lib, rows: int, cols: int, dtype: torch.dtype) -> None:
    """Forward + backward: forward and backward variants alone, steps of both, the op and Liger."""
    from opbuilder.ops.softmax import softmax

    case = f"softmax fwd+bwd {rows}x{cols} {str(dtype)[6:]}"
    elem = torch.finfo(dtype).bits // 8
    step_bytes = 5 * rows * cols * elem
    n = b.sets(2 * step_bytes)
    gen = torch.Generator(device="cuda").manual_seed(2)
    xs = [randn((rows, cols), dtype, gen, 4.0) for _ in range(n)]
    gs = [randn((rows, cols), dtype, gen) for _ in range(n)]
    ys = [torch.softmax(x.float(), -1).to(dtype) for x in xs]  # the backward variants' y
    fwd = [v for k, v in enumerate(lib.family(0, dtype, cols)) if check_softmax_fwd(lib, v, cols, dtype, 200 + k)]
    bwd = [v for k, v in enumerate(lib.family(1, dtype, cols)) if check_softmax_bwd(lib, v, cols, dtype, 300 + k)]

    impls: dict[str, tuple[Callable, Callable | None]] = {}
    for v in fwd:
        impls[f"fwd {v['name']}"] = (lambda i, v=v: lib.sm_fwd(v, xs[i % n], torch.empty_like(xs[i % n])), None)
    for v in bwd:
        impls[f"bwd {v['name']}"] = (
            lambda i, v=v: lib.sm_bwd(v, ys[i % n], gs[i % n], torch.empty_like(ys[i % n])), None)
    b.time(f"{case}: parts", impls, None)

    # Steps: the op's autograd step as `opbuilder bench` times it (x.grad reset before each step, untimed),
    # the same with gradients accumulating (issue 14's table), Liger's, and variant pairs without autograd.
    xg = [x.detach().clone().requires_grad_(True) for x in xs]

    def reset(i: int) -> None:
        xg[i % n].grad = None

    def op_step(i: int) -> None:
        torch.autograd.backward(softmax(xg[i % n]), gs[i % n])

    steps: dict[str, tuple[Callable, Callable | None]] = {}
    reset(0)
    op_step(0)
    y64 = softmax_ref(xs[0])
    g64 = gs[0].double()
    ref = y64 * (g64 - (y64 * g64).sum(-1, keepdim=True))
    if record_check(f"{case} op grad", rel_err(xg[0].grad, ref), TOL[dtype]):
        steps["op"] = (op_step, reset)
        steps["op, grads accumulate"] = (op_step, None)
    liger = liger_softmax()
    if liger is not None:
        def liger_step(i: int) -> None:
            torch.autograd.backward(liger(xg[i % n]), gs[i % n])

        reset(0)
        liger_step(0)
        if record_check(f"{case} liger grad", rel_err(xg[0].grad, ref), 2 * TOL[dtype]):
            steps["liger"] = (liger_step, reset)
    by_name = {v["name"]: v for v in fwd + bwd}
    pairs = [(f, bw) for f in ("128x4 nc/wb", "once 128x4 nc/wb", "once 128x4 nc/cs", "64x8 nc/cs")
             for bw in ("256x2 cs,cs/cs", "512x1 nc,nc/wb", "512x1 cs,cs/cs", "512x1 nc,nc/cs", "512x1 ca,ca/wb")]
    for f, bw in pairs:
        vf = next((v for v in fwd if v["name"] == f), None)
        vb = next((v for v in bwd if v["name"] == bw), None)
        if vf is None or vb is None:
            continue

        def pair(i: int, vf=vf, vb=vb) -> None:
            x = xs[i % n]
            y = torch.empty_like(x)
            lib.sm_fwd(vf, x, y)
            lib.sm_bwd(vb, y, gs[i % n], torch.empty_like(x))

        steps[f"{f} + {bw}"] = (pair, None)
    del by_name
    b.time(case, steps, step_bytes, flush=("op", "liger"))
    steps.clear()
    impls.clear()
    torch.cuda.empty_cache()


# ---- add+RMSNorm -----------------------------------------------------------------------------------------


def rms_ref(x, r, w):
    h = (x.float() + r.float()).to(x.dtype)
    h64 = h.double()
    return h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * w.double(), h


def rmsnorm_case(b: Bench, lib: Lib, rows: int) -> None:
    from opbuilder.ops.fused_add_rmsnorm import reference as eager_add_rmsnorm
    from opbuilder.ops.fused_add_rmsnorm import fused_add_rmsnorm

    hidden = 4096
    case = f"add+RMSNorm fwd {rows}x{hidden} bfloat16"
    nbytes = (4 * rows * hidden + hidden) * 2
    n = b.sets(nbytes)
    gen = torch.Generator(device="cuda").manual_seed(3)
    sets = [(randn((rows, hidden), BF16, gen), randn((rows, hidden), BF16, gen), randn((hidden,), BF16, gen))
            for _ in range(n)]

    def check(what: str, out: torch.Tensor, rout: torch.Tensor, inputs, tol=TOL[BF16]) -> bool:
        ref, h = rms_ref(*inputs)
        return record_check(f"{case} {what}", rel_err(out, ref), tol) & record_check(
            f"{case} {what} residual_out", rel_err(rout, h), 0.0)

    impls: dict[str, tuple[Callable, Callable | None]] = {}
    out, rout = fused_add_rmsnorm(*sets[0], EPS)
    if check("op", out, rout, sets[0]):
        impls["op"] = (lambda i: fused_add_rmsnorm(*sets[i % n], EPS), None)
    torch._dynamo.reset()
    compiled = torch.compile(eager_add_rmsnorm, dynamic=False)
    out, rout = compiled(*sets[0])
    if check("compile", out, rout, sets[0]):
        impls["compile"] = (lambda i: compiled(*sets[i % n]), None)
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction as LF

        out, rout = LF.apply(*sets[0][:2], sets[0][2], EPS)
        if check("liger", out, rout, sets[0], tol=2e-2):
            impls["liger"] = (lambda i: LF.apply(*sets[i % n], EPS), None)
    except Exception as e:
        RESULTS["errors"].append(f"liger add+rmsnorm: {type(e).__name__}: {e}")
        log(f"liger add+rmsnorm unavailable: {type(e).__name__}: {e}")
    srcs = [torch.cat([s[0].view(torch.uint8).reshape(-1), s[1].view(torch.uint8).reshape(-1)]) for s in sets]
    dst = torch.empty_like(srcs[0])
    impls["copy, same bytes"] = (lambda i: dst.copy_(srcs[i % n]), None)

    def touch(i: int) -> None:
        x, r, w = sets[i % n]
        lib.check(lib.lib.q_touch(x.data_ptr(), r.data_ptr(), w.data_ptr(), torch.empty_like(x).data_ptr(),
                                  torch.empty_like(x).data_ptr(), rows, lib.stream()), "touch")

    impls["floor: traffic only"] = (touch, None)
    impls["floor: empty kernel"] = (lambda i: lib.lib.q_empty(rows, 512, lib.stream()), None)
    for k, v in enumerate(lib.family(2, BF16, hidden)):
        gen = torch.Generator(device="cuda").manual_seed(400 + k)
        inputs = (randn((37, hidden), BF16, gen), randn((37, hidden), BF16, gen), randn((hidden,), BF16, gen))
        o, ro = torch.full_like(inputs[0], float("nan")), torch.full_like(inputs[0], float("nan"))
        lib.rms_fwd(v, *inputs, o, ro)
        torch.cuda.synchronize()
        if check(v["name"], o, ro, inputs):
            impls[v["name"]] = (lambda i, v=v: lib.rms_fwd(v, *sets[i % n], torch.empty_like(sets[i % n][0]),
                                                            torch.empty_like(sets[i % n][0])), None)
    b.time(case, impls, nbytes, flush=tuple(impls))
    impls.clear()
    torch.cuda.empty_cache()


# ---- matmul + add + ReLU -----------------------------------------------------------------------------------


def matmul_case(b: Bench, shape: tuple[int, int, int, int]) -> None:
    # (the package's attribute of that name is the function: import the module itself)
    fm = importlib.import_module("opbuilder.ops.fused_matmul_add_relu")

    bsz, m, k, nn = shape
    case = f"matmul+add+ReLU fwd+bwd {bsz}x{m}x{k}x{nn} bfloat16"
    gen = torch.Generator(device="cuda").manual_seed(4)
    footprint = 2 * 2 * bsz * (m * k + k * nn + 2 * m * nn)
    n = b.sets(footprint)

    def make():
        return (randn((bsz, m, k), BF16, gen, k**-0.5), randn((bsz, k, nn), BF16, gen), randn((bsz, m, nn), BF16, gen))

    sets = [make() for _ in range(n)]
    grads = [randn((bsz, m, nn), BF16, gen) for _ in range(n)]
    leaves = [tuple(t.detach().clone().requires_grad_(True) for t in s) for s in sets]

    def reset(i: int) -> None:
        for t in leaves[i % n]:
            t.grad = None

    def op_step(i: int) -> None:
        torch.autograd.backward(fm.fused_matmul_add_relu(*leaves[i % n]), grads[i % n])

    def eager_step(i: int) -> None:
        lhs, rhs, bias = leaves[i % n]
        torch.autograd.backward(torch.relu(lhs @ rhs + bias), grads[i % n])

    # The floor: the three GEMMs as the op's backward issues them, and one pass over the gradient (the ReLU
    # mask), on the same inputs, no autograd.
    def floor_step(i: int) -> None:
        lhs, rhs, _ = sets[i % n]
        out = torch.matmul(lhs, rhs)
        gp = torch.ops.aten.threshold_backward(grads[i % n], out, 0)
        fm._grad_lhs(gp, lhs.shape, rhs)
        fm._grad_rhs(gp, lhs, rhs.shape, fm._transposed(rhs))

    outs = [torch.matmul(s[0], s[1]) for s in sets[:1]]
    gps = [torch.ops.aten.threshold_backward(grads[0], outs[0], 0)]
    parts = {
        "part: GEMM lhs @ rhs": (lambda i: torch.matmul(sets[i % n][0], sets[i % n][1]), None),
        "part: op forward": (lambda i: fm.fused_matmul_add_relu(*sets[i % n]), None),
        "part: mask pass": (lambda i: torch.ops.aten.threshold_backward(grads[i % n], outs[0], 0), None),
        "part: GEMM grad_lhs": (lambda i: fm._grad_lhs(gps[0], sets[i % n][0].shape, sets[i % n][1]), None),
        "part: GEMM grad_rhs": (lambda i: fm._grad_rhs(gps[0], sets[i % n][0], sets[i % n][1].shape,
                                                                fm._transposed(sets[i % n][1])), None),
    }
    # check the op's step against float64 once
    reset(0)
    op_step(0)
    lhs, rhs, bias = (t.double() for t in sets[0])
    pre = lhs @ rhs + bias
    gp64 = grads[0].double() * (pre > 0)
    refs = (gp64 @ rhs.mT, lhs.mT @ gp64, gp64)
    ok = all(record_check(f"{case} op grad {name}", rel_err(t.grad, r), 2e-2)
             for name, t, r in zip(("lhs", "rhs", "bias"), leaves[0], refs))
    steps = {"floor: 3 GEMMs + mask pass": (floor_step, None), "eager": (eager_step, reset)}
    if ok:
        steps["op"] = (op_step, reset)
        steps["op, grads accumulate"] = (op_step, None)
    steps.update(parts)
    b.time(case, steps, None)
    steps.clear()
    torch.cuda.empty_cache()


# ---- softmax sweep: two trees' launchers, default plans ----------------------------------------------------

SWEEP_SRCS = ["softmax/softmax.cu", "softmax/softmax_forward.cu", "softmax/softmax_backward.cu"]
DTYPE_CODE = {FP32: 0, torch.float16: 1, BF16: 2}
SWEEP_FWD = [((4096, 4096), FP32), ((4096, 4096), BF16), ((8192, 4096), FP32), ((4096, 3000), FP32),
             ((32768, 4096), BF16), ((32768, 2048), FP32), ((32768, 1024), BF16), ((16384, 2048), BF16),
             ((4096, 1000), torch.float16), ((8192, 8192), FP32), ((4096, 16384), BF16), ((65536, 256), FP32)]
SWEEP_BWD = [((32768, 4096), BF16), ((32768, 2048), FP32), ((16384, 3072), BF16), ((4096, 4096), FP32),
             ((8192, 8192), FP32), ((4096, 32768), BF16), ((32768, 1024), BF16), ((512, 65536), FP32),
             ((4096, 1000), torch.float16)]


def build_sweep(rev: str) -> None:
    """sweep_base.so from git `rev`'s kernels, sweep_new.so from the working tree's."""
    out = LIB_PATH.parent
    base = out / "base_tree"
    subprocess.run(["rm", "-rf", str(base)], check=True)
    base.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "kernels", "opbuilder/include"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    shim = Path(__file__).with_name("peer_cases_sweep.cu")
    for name, tree in (("base", base), ("new", ROOT)):
        flags = [f for f in NVCC_FLAGS if f not in ("-Ikernels", "-Iopbuilder/include")]
        cmd = [NVCC, *flags, f"-I{tree / 'kernels'}", f"-I{tree / 'opbuilder/include'}", str(shim),
               *(str(tree / "kernels" / src) for src in SWEEP_SRCS), "-o", str(out / f"sweep_{name}.so")]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        (out / f"sweep_{name}.log").write_text(res.stdout + res.stderr)
        if res.returncode != 0:
            raise SystemExit(f"nvcc failed for {name}:\n{res.stderr[-4000:]}")
        log(f"built sweep_{name}.so")


class SweepLib:
    def __init__(self, name: str) -> None:
        self.lib = ctypes.CDLL(str(LIB_PATH.parent / f"sweep_{name}.so"))
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self.lib.s_plan.argtypes = [vp, vp, i64, i64, ci, ci, ctypes.POINTER(ci)]
        self.lib.s_plan.restype = i64
        self.lib.s_fwd.argtypes = [vp, vp, i64, i64, ci, vp, vp]
        self.lib.s_bwd.argtypes = [vp, vp, vp, i64, i64, ci, vp, vp]
        self.ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def plan(self, x: torch.Tensor, backward: bool) -> tuple[list[int], int]:
        arr = (ctypes.c_int * 4)()
        need = self.lib.s_plan(x.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], DTYPE_CODE[x.dtype], int(backward),
                               arr)
        return list(arr), need

    def fwd(self, x: torch.Tensor, y: torch.Tensor) -> None:
        rc = self.lib.s_fwd(x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], DTYPE_CODE[x.dtype],
                            self.ws.data_ptr(), Lib.stream())
        if rc:
            raise RuntimeError(f"forward returned {rc}")

    def bwd(self, y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> None:
        rc = self.lib.s_bwd(y.data_ptr(), dy.data_ptr(), dx.data_ptr(), y.shape[0], y.shape[1], DTYPE_CODE[y.dtype],
                            self.ws.data_ptr(), Lib.stream())
        if rc:
            raise RuntimeError(f"backward returned {rc}")


def sweep(b: Bench) -> None:
    libs = {name: SweepLib(name) for name in ("base", "new")}
    rows_out = []
    for backward, cases in ((False, SWEEP_FWD), (True, SWEEP_BWD)):
        for shape, dtype in cases:
            label = f"softmax {'bwd' if backward else 'fwd'} {shape[0]}x{shape[1]} {str(dtype)[6:]}"
            elem = torch.finfo(dtype).bits // 8
            nbytes = (3 if backward else 2) * shape[0] * shape[1] * elem
            n = b.sets(nbytes)
            gen = torch.Generator(device="cuda").manual_seed(5)
            xs = [randn(shape, dtype, gen, 4.0) for _ in range(n)]
            ys = [torch.softmax(x.float(), -1).to(dtype) for x in xs] if backward else None
            gs = [randn(shape, dtype, gen) for _ in range(n)] if backward else None
            impls: dict[str, tuple[Callable, Callable | None]] = {}
            plans = {}
            for name, lib in libs.items():
                plans[name], need = lib.plan(xs[0], backward)
                if need > lib.ws.numel():
                    log(f"  {label} {name}: workspace {need} B > 64 MiB, skipped")
                    continue
                # fresh inputs, poisoned output, float64 reference
                cg = torch.Generator(device="cuda").manual_seed(600 + len(RESULTS["checks"]))
                x = randn((min(shape[0], 45), shape[1]), dtype, cg, 4.0)
                x[1, : shape[1] // 2] = float("-inf")
                out = torch.full_like(x, float("nan"))
                if backward:
                    y = torch.softmax(x.float(), -1).to(dtype)
                    dy = randn(x.shape, dtype, cg)
                    lib.bwd(y, dy, out)
                    y64, dy64 = y.double(), dy.double()
                    ref = y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
                else:
                    lib.fwd(x, out)
                    ref = softmax_ref(x)
                torch.cuda.synchronize()
                if not record_check(f"sweep {label} {name} {plans[name]}", rel_err(out, ref), TOL.get(dtype, 1e-2)):
                    continue
                if backward:
                    impls[name] = (lambda i, lib=lib: lib.bwd(ys[i % n], gs[i % n], torch.empty_like(ys[i % n])),
                                   None)
                else:
                    impls[name] = (lambda i, lib=lib: lib.fwd(xs[i % n], torch.empty_like(xs[i % n])), None)
            rows = b.time(label, impls, nbytes)
            t = {r["impl"]: r for r in rows}
            if "base" in t and "new" in t:
                rows_out.append((label, plans["base"], t["base"]["us"], plans["new"], t["new"]["us"]))
            impls.clear()
            del xs, ys, gs
            torch.cuda.empty_cache()
    log("\n== sweep: default plans, base tree against the working tree (us, median)")
    for label, pb, ub, pn, un in rows_out:
        log(f"  {label:<34} base {str(pb):<18} {ub:9.2f}   new {str(pn):<18} {un:9.2f}   new/base {un / ub:.3f}")
    RESULTS["sweep"] = rows_out


# ---- main ----------------------------------------------------------------------------------------------


def summary() -> None:
    def us(case: str, impl: str) -> float | None:
        return next((r["us"] for r in RESULTS["cases"].get(case, []) if r["impl"] == impl), None)

    def best(case: str, prefix: str = "") -> tuple[str, float] | tuple[None, None]:
        rows = [r for r in RESULTS["cases"].get(case, []) if r["impl"].startswith(prefix)
                and r["impl"] not in ("op", "liger", "compile", "torch.softmax", "eager", "copy, same bytes")
                and not r["impl"].startswith(("floor", "part", "op,"))]
        if not rows:
            return None, None
        r = min(rows, key=lambda r: r["us"])
        return r["impl"], r["us"]

    log("\n== summary (us, median; bench timer)")
    lines = []
    for case, peer in (("softmax fwd 4096x4096 float32", "liger"), ("softmax fwd+bwd 32768x4096 bfloat16", "liger"),
                       ("add+RMSNorm fwd 4096x4096 bfloat16", "compile"), ("add+RMSNorm fwd 128x4096 bfloat16", "compile")):
        if case not in RESULTS["cases"]:
            continue
        name, t = best(case)
        lines.append(f"{case:<40} op {us(case, 'op') or float('nan'):8.2f}  {peer} {us(case, peer) or float('nan'):8.2f}"
                     f"  best variant {t or float('nan'):8.2f} ({name})")
    for shape in ("1x4096x4096x4096", "8x2048x2048x2048"):
        case = f"matmul+add+ReLU fwd+bwd {shape} bfloat16"
        if case not in RESULTS["cases"]:
            continue
        op, fl = us(case, "op"), us(case, "floor: 3 GEMMs + mask pass")
        ratio = op / fl if op and fl else float("nan")
        lines.append(f"{case:<40} op {op or float('nan'):8.2f}  floor {fl or float('nan'):8.2f}  op/floor {ratio:.3f}")
    fails = [c for c in RESULTS["checks"] if not c["ok"]]
    lines.append(f"checks: {len(RESULTS['checks'])}, failed {len(fails)}; errors {len(RESULTS['errors'])}")
    for line in lines:
        log(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="only build the variant library (here, with nvcc)")
    parser.add_argument("--build-sweep", metavar="REV", help="only build the sweep's two libraries (REV: the base)")
    parser.add_argument("--only", default="softmax,step,rmsnorm,matmul,others",
                        help="comma-separated sections: softmax, step, rmsnorm, matmul, others, sweep")
    args = parser.parse_args()
    if args.build:
        build()
        return
    if args.build_sweep:
        build_sweep(args.build_sweep)
        return
    os.chdir(ROOT)
    only = set(args.only.split(","))
    lib = Lib() if only - {"sweep"} else None
    RESULTS["variants"] = [{k: v for k, v in d.items() if k != "dtype"} | {"dtype": str(d["dtype"])}
                           for d in (lib.variants if lib else [])]
    b = Bench()
    sections: list[tuple[str, Callable[[], None]]] = [
        ("softmax", lambda: softmax_forward_case(b, lib, 4096, 4096, FP32, flush=True)),
        ("step", lambda: softmax_step_case(b, lib, 32768, 4096, BF16)),
        ("rmsnorm", lambda: rmsnorm_case(b, lib, 4096)),
        ("rmsnorm", lambda: rmsnorm_case(b, lib, 128)),
        ("matmul", lambda: matmul_case(b, (1, 4096, 4096, 4096))),
        ("matmul", lambda: matmul_case(b, (8, 2048, 2048, 2048))),
        ("others", lambda: softmax_forward_case(b, lib, 4096, 4096, BF16, flush=False)),
        ("others", lambda: softmax_forward_case(b, lib, 16384, 32768, FP32, flush=False)),
        ("others", lambda: softmax_forward_case(b, lib, 16384, 32768, BF16, flush=False)),
        ("sweep", lambda: sweep(b)),
    ]
    for name, fn in sections:
        if name not in only:
            continue
        t0 = time.time()
        try:
            fn()
        except Exception as e:
            RESULTS["errors"].append(f"{name}: {type(e).__name__}: {e}")
            traceback.print_exc()
        log(f"  ({name}: {time.time() - t0:.0f} s)")
        (OUT / "peer_cases.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    summary()
    (OUT / "peer_cases.json").write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
