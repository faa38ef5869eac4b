"""Load-time targets of issue 2, each in fresh processes.

- Warm load: `import torch` alone vs `import torch` then loading an op already in the cache. Reported as
  the difference of the median process wall times, and as the median of the load step timed inside
  the process (the build key's hashing included). Target: at most 20 ms more than `import torch`.
- First call: importing the op's Python module, then calling it once on a tiny tensor (load, fake and
  autograd registrations included), each timed inside the process.
- Cold build: the op's load() into an empty cache, in seconds. Targets: relu at most 8 s CPU-only on
  the 2-core machine, at most 6 s with CUDA on the H100 machine.

Usage: python benchmarks/warm_load.py [--op relu] [--repeats 15] [--cold-repeats 1] [--json FILE]
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


def run(code: str, cache: Path) -> tuple[float, dict]:
    """Runs ``code`` in a fresh interpreter with OPB_CACHE_DIR=cache; returns (wall seconds, its printed dict)."""
    env = dict(os.environ, OPB_CACHE_DIR=str(cache))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"child process failed ({proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def out_ms(samples: dict[str, list[float]], key: str) -> str:
    return f"{samples[key][-1] * 1e3:.1f} ms"


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="relu")
    p.add_argument("--repeats", type=int, default=15, help="fresh processes for each warm measurement")
    p.add_argument("--cold-repeats", type=int, default=1, help="cold builds, each into a new empty cache")
    p.add_argument("--json", type=Path, help="write the numbers to this file")
    args = p.parse_args(argv)

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
