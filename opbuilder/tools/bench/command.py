"""``opbuilder bench [OP ...] [--shapes ...] [--dtype ...] [--backward] [--json F] [--markdown F] [--plot F]``."""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
from pathlib import Path

import torch

from opbuilder.tools.bench import host, liger, report
from opbuilder.tools.bench.runner import BACKWARD, FORWARD, Case, CaseRunner, load_ours
from opbuilder.tools.bench.specs import SPECS, Fn, OpSpec, Shape, dtype_name, parse_dtype, parse_shape
from opbuilder.dispatch.timing import CpuTimer, CudaTimer, Timer, copy_bandwidth

DESCRIPTION = """\
Time opbuilder's ops beside PyTorch eager, torch.compile and, on CUDA where it is installed (pip install
'opbuilder[liger]'), Liger-Kernel, on the same random inputs, in one run, and
print a table: time per call (median), GB/s under each op's least-bytes model (TFLOP/s for the matmul),
"of copy" (GB/s over a large copy's, measured first in the same run), and speedups ("vs eager" = eager's
time / this row's: above 1 is faster). A table of host time per call on tiny inputs follows.

Without --shapes each op runs at its usual sizes: on CUDA the sizes of benchmarks/RESULTS.md (LLM shapes
such as 32768x4096 bf16), on a CPU fp32 4096x4096. A run of every op takes a few minutes.

examples:
  opbuilder bench                                   every op at its usual sizes
  opbuilder bench softmax --shapes 4096x4096 --dtype fp32 bf16
  opbuilder bench fused_add_rmsnorm --backward --markdown RESULTS.md --json r.json
  opbuilder bench --device cpu relu --shapes 1024x1024
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opbuilder bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*", metavar="OP", help=f"ops to time (default: all): {', '.join(SPECS)}")
    p.add_argument("--shapes", nargs="+", metavar="SHAPE",
                   help="shapes such as 4096x4096 (ROWSxHIDDEN); the matmul takes BxMxKxN (full-shape bias) or "
                        "MxKxN (vector bias). A shape that does not fit an op is skipped for it.")
    p.add_argument("--dtype", nargs="+", metavar="DTYPE", help="fp32, bf16, fp16 or fp64 (default: each op's usual dtype on the device)")
    p.add_argument("--backward", action="store_true", help="also time forward+backward steps")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--json", type=Path, metavar="FILE", help="write every number to FILE")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="write the results table (RESULTS.md) to FILE")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw the speedups (needs matplotlib)")
    p.add_argument("--budget-ms", type=float, metavar="MS",
                   help="time spent on the repeats of each implementation (default 200 on CUDA, 1000 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--no-host", action="store_true",
                   help="skip the host-time table (CPU time per call of ours and of the PyTorch calls it replaces, "
                        "on 16-element inputs)")
    return p


def _cases(specs: list[OpSpec], shapes: list[Shape] | None, dtypes: list[torch.dtype] | None, device: torch.device,
           backward: bool) -> tuple[list[Case], dict[str, str]]:
    """The cases to run, and the ops left out with why."""
    cases, skipped = [], {}
    for spec in specs:
        device_cases = spec.cpu_cases if device.type == "cpu" else spec.cuda_cases
        for mode in [FORWARD] + ([BACKWARD] if backward else []):
            if shapes is not None:
                fitting = [s for s in shapes if len(s) in spec.ranks]
                if not fitting:
                    skipped[spec.name] = f"no given shape fits: {spec.shape_help}"
                defaults = [(s, device_cases[0][1]) for s in fitting]  # the op's usual dtype on this device
            elif device.type == "cuda" and mode == BACKWARD:
                defaults = list(spec.cuda_backward_cases)
            else:
                defaults = list(device_cases)
            for shape, default_dtype in defaults:
                for dtype in dtypes or [default_dtype]:
                    case = Case(spec, shape, dtype, mode)
                    if case not in cases:
                        cases.append(case)
    return cases, skipped


def _environment(device: torch.device, timer: Timer) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": device.type,
        "cache_bytes": timer.cache_bytes(),
    }
    try:
        from opbuilder import __version__ as opb_version
    except ImportError:
        opb_version = "?"
    env["opbuilder"] = opb_version
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["device_detail"] = (f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
                                f"{env['cache_bytes'] / 2**20:.0f} MiB L2")
    else:
        env["device_name"] = _cpu_name()
        env["device_detail"] = f"{torch.get_num_threads()} threads"
    return env


def _host_rows(cases: list[Case], loaded: dict[str, Fn | None], device: torch.device) -> list[dict]:
    """Host µs per call of each op that ran, beside the PyTorch call(s) it replaces (opbuilder/tools/bench/host.py)."""
    rows: list[dict] = []
    names = [name for name in dict.fromkeys(c.spec.name for c in cases) if loaded.get(name) and name in host.HOST_CASES]
    if names:
        print("  host time per call (16-element inputs):", ", ".join(names), flush=True)
    for name in names:
        try:
            rows += host.measure_op(name, loaded[name], device)
        except Exception as e:  # the device table is already measured: report, do not lose it
            rows.append({"op": name, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})
    return rows


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU: " + (platform.processor() or platform.machine())


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 when everything asked for ran (ops not written yet are only reported), 1 when an op,
    an implementation or a check failed, 2 for a bad command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse has printed
        return int(e.code or 0)

    try:
        from opbuilder import env

        env.validate()  # a variable to fix (EnvError, a ValueError): said before anything is timed
        unknown = [op for op in args.ops if op not in SPECS]
        if unknown:
            raise ValueError(f"unknown op {', '.join(map(repr, unknown))}; known ops: {', '.join(SPECS)}")
        misplaced = [s for s in args.shapes or [] if s in SPECS]
        if misplaced:
            raise ValueError(f"--shapes got the op name {misplaced[0]!r}: put op names before --shapes")
        shapes = [parse_shape(s) for s in args.shapes] if args.shapes else None
        dtypes = [parse_dtype(d) for d in args.dtype] if args.dtype else None
        if args.budget_ms is not None and args.budget_ms <= 0:
            raise ValueError(f"--budget-ms must be positive, got {args.budget_ms}")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
        for path in (args.json, args.markdown, args.plot):
            if path is not None and not path.parent.is_dir():
                raise ValueError(f"cannot write {path}: folder {path.parent} does not exist")
    except ValueError as e:
        print(f"opbuilder bench: error: {e}", file=sys.stderr)
        return 2

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    specs = [SPECS[op] for op in (args.ops or SPECS)]
    cases, skipped = _cases(specs, shapes, dtypes, device, args.backward)
    if not cases:
        reasons = "; ".join(f"{op}: {why}" for op, why in skipped.items())
        print(f"opbuilder bench: error: nothing to run ({reasons})", file=sys.stderr)
        return 2

    if device.type == "cuda":
        timer: Timer = CudaTimer(device, **({"budget_ms": args.budget_ms} if args.budget_ms else {}))
        timing = ("CUDA events around each call, after a sleep kernel that hides the host's launch time; "
                  "warm-up, then the median of the repeats")
    else:
        timer = CpuTimer(**({"budget_ms": args.budget_ms} if args.budget_ms else {}))
        timing = f"wall clock around each call, warm-up, then the median; {torch.get_num_threads()} threads"
    timing += "; inputs rotated among enough random sets to span 4x the last-level cache when one set is smaller"

    env = _environment(device, timer)
    liger_module, env["liger"] = (None, "not asked for: no op with a Liger counterpart") \
        if not any(c.spec.name in liger.ADAPTERS for c in cases) else liger.load(device)
    env["liger_loaded"] = liger_module is not None
    print(f"opbuilder bench on {env['device_name']}: measuring the copy bandwidth", flush=True)
    copy = copy_bandwidth(timer)
    runner = CaseRunner(timer, copy["GBps"], seed=args.seed, liger=liger_module)

    rows: list[dict] = []
    result = {
        "command": "opbuilder bench" + ("" if not argv else " " + shlex.join(argv)),
        "complete": False,
        "env": env,
        "copy": copy,
        "settings": {"timing": timing, "budget_ms": timer.budget_ms, "warmup_ms": timer.warmup_ms,
                     "rounds": timer.rounds, "seed": args.seed, "cases": [c.label() for c in cases]},
        "cost_models": {},
        "rows": rows,
        "skipped": skipped,
    }
    failed = False
    loaded: dict[str, Fn | None] = {}
    for case in cases:
        name = case.spec.name
        if name not in loaded:
            loaded[name], why, is_error = load_ours(case.spec)
            if loaded[name] is None:
                skipped[name] = why or "unavailable"
                failed |= is_error
        ours = loaded[name]
        if ours is None:
            continue
        print(f"  {case.label()}", end=" ", flush=True)
        try:
            case_rows = runner.run(case, ours)
        except Exception as e:  # e.g. out of memory making the inputs: the other cases still run
            case_rows = [{"op": name, "shape": list(case.shape), "dtype": dtype_name(case.dtype), "pass": case.mode,
                          "impl": "ours", "device": device.type, "bytes": None, "flops": None,
                          "error": f"{type(e).__name__}: {str(e).strip()[:300]}"}]
        print(report.one_line(case_rows), flush=True)
        failed |= any(r.get("error") or r.get("check") in ("fail", "error") for r in case_rows)
        rows.extend(case_rows)
        result["cost_models"][name] = {"fwd": case.spec.cost_model, "fwd+bwd": case.spec.cost_model_backward}
        if args.json:  # after each case, so a run cut short still leaves its numbers
            report.write_json(result, args.json)
    if not args.no_host:
        result["host"] = _host_rows(cases, loaded, device)
    result["complete"] = True

    report.print_report(result)
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.markdown:
        report.write_markdown(result, args.markdown)
        print(f"wrote {args.markdown}")
    if args.plot:
        try:
            report.write_plot(result, args.plot)
            print(f"wrote {args.plot}")
        except RuntimeError as e:
            print(f"opbuilder bench: error: {e}", file=sys.stderr)
            return 1
    return 1 if failed else 0

