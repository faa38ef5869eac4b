"""Host time per call of each op against the PyTorch call, or unfused sequence, it replaces (issue 14,
part 4): 16-element inputs, one thread, with and without requires_grad, and a forward and backward
(issue 23), ours with its C++ gradient path beside the Python one.

    python benchmarks/host_overhead.py [--device cpu|cuda] [--json FILE] [OP ...]

Exit status 1 when a ratio misses its target (relu and softmax at most 2.5x the torch call forward, 2x
forward and backward; a fused op no slower than the unfused sequence). See opbuilder/bench/host.py for how it is measured.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

from opbuilder.bench import host
from opbuilder.bench.specs import SPECS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*", metavar="OP", help=f"default: all of {', '.join(host.HOST_CASES)}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1, as in the issue)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the rows to FILE")
    args = p.parse_args(argv)
    unknown = [op for op in args.ops if op not in host.HOST_CASES]
    if unknown:
        p.error(f"unknown op {', '.join(unknown)}; known: {', '.join(host.HOST_CASES)}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for op in args.ops or list(host.HOST_CASES):
        spec = SPECS[op]
        ours = spec.call_ours(getattr(importlib.import_module(spec.module), spec.function))
        rows += host.measure_op(op, ours, device)
    print(f"Host time per call (forward; fwd+bwd: forward and backward), {device.type}, {args.threads} thread(s), torch {torch.__version__} "
          "(thread CPU time, least of 15 rounds of 2000 calls):")
    print(host.table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
