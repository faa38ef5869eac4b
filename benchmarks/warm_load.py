"""Load-time targets of issue 2, each in fresh processes.

- Warm load: `import torch` alone vs `import torch` then loading an op already in the cache. Reported as
  the difference of the median process wall times, and as the median of the load step timed inside
  the process (the build key's hashing included). Target: at most 20 ms more than `import torch`.
- First call: importing the op's Python module, then calling it once on a tiny tensor (load, fake and
  autograd registrations included), each timed inside the process.
- Cold build: the op's load() into an empty cache, in seconds. Targets: relu at most 8 s CPU-only on
  the 2-core machine, at most 6 s with CUDA on the H100 machine.
- Light first call (``--light``, alone): ``import opbuilder.ops as ops; ops.<op>(x)`` on 16 floats after
  ``import torch``, the op already in the cache, against ``x = torch.randn(16)`` alone: the median over
  fresh processes (7 by default) of the time after ``import torch``, wall and CPU (``time.process_time``,
  which other processes on the machine disturb less), with its spread. Target (issue 22): at most 15 ms.
  ``--light DIR ...`` measures other checkouts too (e.g. ``git archive main | tar -x -C DIR``), interleaved
  with this one; run it with an interpreter that has no editable install of opbuilder (the system
  python), so that each child imports the checkout it is given (PYTHONPATH) and nothing else.

Usage: python benchmarks/warm_load.py [--op relu] [--repeats 15] [--cold-repeats 1] [--json FILE]
       python benchmarks/warm_load.py --light [DIR ...] [--op relu] [--repeats 7] [--json FILE]
The warm runs use OPB_CACHE_DIR when set (else a temporary cache); cold builds always use new empty
folders. TORCH_CUDA_ARCH_LIST applies as usual (set it to 9.0 on the H100 machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPORT_ONLY = """
import json, time
t0 = time.perf_counter()
import torch
print(json.dumps({"import_torch_s": time.perf_counter() - t0}))
"""

LOAD = """
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from opbuilder.jit.registry import get_builder
get_builder({op!r}).load()
t2 = time.perf_counter()
print(json.dumps({{"import_torch_s": t1 - t0, "load_s": t2 - t1}}))
"""

FIRST_CALL = """
import importlib, json, time
import torch
x = torch.randn(8)
t0 = time.perf_counter()
fn = getattr(importlib.import_module("opbuilder.ops." + {op!r}), {op!r})
t1 = time.perf_counter()
fn(x)
t2 = time.perf_counter()
print(json.dumps({{"import_op_module_s": t1 - t0, "first_call_s": t2 - t1}}))
"""

COLD = """
import json, time
import torch
from opbuilder.jit.registry import get_builder
b = get_builder({op!r})
t0 = time.perf_counter()
b.load()
print(json.dumps({{"build_s": time.perf_counter() - t0, "cuda": torch.cuda.is_available()}}))
"""


LIGHT = """
import json, time
c0, t0 = time.process_time(), time.perf_counter()
import torch
c1, t1 = time.process_time(), time.perf_counter()
x = torch.randn(16)
{call}
c2, t2 = time.process_time(), time.perf_counter()
print(json.dumps({{"wall_s": t2 - t1, "cpu_s": c2 - c1, "torch_s": t1 - t0}}))
"""
LIGHT_CALL = "import opbuilder.ops as ops\nops.{op}(x)"


def run(code: str, cache: Path, checkout: Path | None = None) -> tuple[float, dict]:
    """Runs ``code`` in a fresh interpreter with OPB_CACHE_DIR=cache (and ``checkout`` first on the path,
    as its working folder); returns (wall seconds, its printed dict)."""
    env = dict(os.environ, OPB_CACHE_DIR=str(cache))
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                          cwd=checkout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"child process failed ({proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def out_ms(samples: dict[str, list[float]], key: str) -> str:
    return f"{samples[key][-1] * 1e3:.1f} ms"


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def spread_ms(values: list[float]) -> str:
    return f"{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"


def light(op: str, repeats: int, checkouts: list[Path], cache: Path) -> dict:
    """The light-first-call measure (see the module docstring) of each checkout, interleaved."""
    call = LIGHT.format(call=LIGHT_CALL.format(op=op))
    for checkout in checkouts:  # builds the op if needed and keeps the key's memo; not timed
        for _ in range(2):
            run(call, cache, checkout)
    base: list[dict] = []
    runs: dict[str, list[dict]] = {str(c): [] for c in checkouts}
    for k in range(repeats):
        base.append(run(LIGHT.format(call=""), cache)[1])
        for checkout in checkouts:
            runs[str(checkout)].append(run(call, cache, checkout)[1])
        print(f"  [{k + 1}/{repeats}]", flush=True)
    out = {"op": op, "repeats": repeats, "import_torch_ms": median_ms([b["torch_s"] for b in base]),
           "baseline_after_torch_ms": median_ms([b["wall_s"] for b in base]), "checkouts": {}}
    print(f"light first call of {op} after `import torch` (median of {repeats} fresh processes, spread min-max; "
          f"`x = torch.randn(16)` alone: {out['baseline_after_torch_ms']:.2f} ms; import torch "
          f"{out['import_torch_ms']:.0f} ms):")
    for name, samples in runs.items():
        wall, cpu = [s["wall_s"] for s in samples], [s["cpu_s"] for s in samples]
        over = median_ms(wall) - out["baseline_after_torch_ms"]
        out["checkouts"][name] = {"wall_ms": median_ms(wall), "over_torch_ms": over, "cpu_ms": median_ms(cpu),
                                  "wall_spread_ms": spread_ms(wall), "cpu_spread_ms": spread_ms(cpu),
                                  "samples_s": samples}
        print(f"  {name}: {over:.1f} ms over import torch (wall {median_ms(wall):.1f} ms, {spread_ms(wall)}; "
              f"CPU {median_ms(cpu):.1f} ms, {spread_ms(cpu)}); target <= 15")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="relu")
    p.add_argument("--repeats", type=int, default=None, help="fresh processes for each warm measurement (15; --light: 7)")
    p.add_argument("--cold-repeats", type=int, default=1, help="cold builds, each into a new empty cache")
    p.add_argument("--light", nargs="*", type=Path, metavar="DIR",
                   help="only the light first call, of this checkout and of each DIR (other checkouts)")
    p.add_argument("--json", type=Path, help="write the numbers to this file")
    args = p.parse_args(argv)
    if args.light is not None:
        with tempfile.TemporaryDirectory(prefix="opb-light-") as tmp:
            cache = Path(os.environ.get("OPB_CACHE_DIR") or tmp)
            checkouts = [Path(__file__).resolve().parent.parent] + [d.resolve() for d in args.light]
            result = light(args.op, args.repeats or 7, checkouts, cache)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.json}")
        return 0
    args.repeats = args.repeats or 15

    import torch

    result: dict = {
        "op": args.op, "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
        "cpus": os.cpu_count(), "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory(prefix="opb-warm-load-") as tmp:
        cache = Path(os.environ.get("OPB_CACHE_DIR") or Path(tmp) / "warm")
        print(f"warm cache: {cache} (building {args.op} there first if needed)", flush=True)
        wall, _out = run(LOAD.format(op=args.op), cache)  # makes sure the op is cached; not timed
        print(f"  ready in {wall:.1f} s", flush=True)

        walls: dict[str, list[float]] = {"import": [], "load": []}
        inner: dict[str, list[float]] = {"import_torch_s": [], "load_s": [], "import_op_module_s": [], "first_call_s": []}
        for k in range(args.repeats):  # interleaved, so drift in the machine's load hits both alike
            wall, _out = run(IMPORT_ONLY, cache)
            walls["import"].append(wall)
            wall, out = run(LOAD.format(op=args.op), cache)
            walls["load"].append(wall)
            inner["import_torch_s"].append(out["import_torch_s"])
            inner["load_s"].append(out["load_s"])
            _wall, out = run(FIRST_CALL.format(op=args.op), cache)
            inner["import_op_module_s"].append(out["import_op_module_s"])
            inner["first_call_s"].append(out["first_call_s"])
            print(f"  [{k + 1}/{args.repeats}] process wall: import torch {walls['import'][-1] * 1e3:.0f} ms, "
                  f"import torch + load {walls['load'][-1] * 1e3:.0f} ms; in process: load {out_ms(inner, 'load_s')}, "
                  f"import op module {out_ms(inner, 'import_op_module_s')}, first call {out_ms(inner, 'first_call_s')}",
                  flush=True)

        result["warm"] = {
            "process_import_torch_ms": median_ms(walls["import"]),
            "process_import_torch_and_load_ms": median_ms(walls["load"]),
            "difference_ms": median_ms(walls["load"]) - median_ms(walls["import"]),
            "in_process_import_torch_ms": median_ms(inner["import_torch_s"]),
            "in_process_load_ms": median_ms(inner["load_s"]),
            "in_process_import_op_module_ms": median_ms(inner["import_op_module_s"]),
            "in_process_first_call_ms": median_ms(inner["first_call_s"]),
            "samples_s": {**walls, **inner},
        }
        w = result["warm"]
        print(f"warm load of {args.op}, median of {args.repeats} fresh processes:")
        print(f"  process wall: import torch {w['process_import_torch_ms']:.0f} ms; import torch + load "
              f"{w['process_import_torch_and_load_ms']:.0f} ms; difference {w['difference_ms']:.1f} ms (target <= 20)")
        print(f"  in process: load() {w['in_process_load_ms']:.1f} ms; import opbuilder.ops.{args.op} "
              f"{w['in_process_import_op_module_ms']:.1f} ms, then its first call {w['in_process_first_call_ms']:.1f} ms")

        builds = []
        for k in range(args.cold_repeats):
            wall, out = run(COLD.format(op=args.op), Path(tmp) / f"cold{k}")
            builds.append({"build_s": out["build_s"], "process_s": wall, "cuda": out["cuda"]})
            print(f"  cold build {k + 1}/{args.cold_repeats}: {out['build_s']:.1f} s", flush=True)
        if builds:
            result["cold"] = {"median_build_s": statistics.median(b["build_s"] for b in builds), "runs": builds}
            kind = "with CUDA" if builds[0]["cuda"] else "CPU only"
            print(f"cold build of {args.op} ({kind}) into an empty cache: "
                  f"{result['cold']['median_build_s']:.1f} s (median of {len(builds)}; targets: 8 s CPU-only on 2 cores, "
                  f"6 s with CUDA on the H100 machine)")

    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
