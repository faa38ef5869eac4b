"""Where one model's training step spends its host time, by native frame: a loop for py-spy.

    py-spy record --native --format raw -r 997 -o ours.txt -- python3 benchmarks/tuning/step_pyspy.py ours
    py-spy record --native --format raw -r 997 -o pytorch.txt -- python3 benchmarks/tuning/step_pyspy.py pytorch
    python3 benchmarks/tuning/step_pyspy.py --fold ours.txt pytorch.txt

The loop: FFNModel (dim 256, hidden 1024, 1024 tokens, bf16 on CUDA) steps as benchmarks/train_step.py takes
them, for --seconds after a warm-up (the C++ gradient glue loaded first). --fold reads py-spy's raw (collapsed)
stacks and prints, per file, the samples whose stack holds each marker below (inclusive) and the top leaf
frames (self), as shares of the samples taken inside a step.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

#: Inclusive markers: a sample counts for each marker a frame of its stack contains.
MARKERS = ("_step", "forward", "backward", "run_backward", "evaluate_function", "opb", "torch::stable",
           "aoti_torch", "empty_strided", "cudaLaunchKernel", "cuLaunchKernel", "THPVariable", "callBoxed",
           "OperatorHandle", "VariableType", "autograd::Node", "python_dispatch", "_ops.py", "module.py",
           "malloc", "CUDACachingAllocator", "Dispatcher", "pybind11")


def loop(which: str, seconds: float) -> None:
    import torch

    from parallel_models import FFNModel, twins
    from train_step import _step
    from opbuilder.torchop import cxx_autograd

    fused, plain = twins(FFNModel, 256, 1024, torch.bfloat16, "cuda")
    model = fused if which == "ours" else plain
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 256, generator=gen).to("cuda", torch.bfloat16)
    target = torch.randn(1024, 256, generator=gen).to("cuda")  # float32: _step compares model(x).float() with it
    if which == "ours":
        cxx_autograd.load(wait=True)
    for _ in range(50):
        _step(model, x, target)
    torch.cuda.synchronize()

    def timed_steps() -> int:  # the frame --fold counts: the steps after the warm-up
        steps, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            _step(model, x, target)
            steps += 1
        return steps

    steps = timed_steps()
    torch.cuda.synchronize()
    print(f"{which}: {steps} steps in {seconds} s, {seconds / steps * 1e6:.1f} us a step", file=sys.stderr, flush=True)


def fold(paths: list[Path]) -> None:
    for path in paths:
        inclusive: collections.Counter[str] = collections.Counter()
        leaves: collections.Counter[str] = collections.Counter()
        total = 0
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if "timed_steps (" not in stack:  # the steps after the warm-up, not the imports and set-up
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            leaves[frames[-1][:110]] += n
            for marker in MARKERS:
                if any(marker in f for f in frames):
                    inclusive[marker] += n
        print(f"== {path.name}: {total} samples in the steps")
        for marker in MARKERS:
            print(f"  {inclusive[marker] / max(total, 1):6.1%}  {marker}")
        print("  top leaf frames:")
        for frame, n in leaves.most_common(25):
            print(f"  {n / max(total, 1):6.1%}  {frame}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", nargs="*", help="ours | pytorch (the loop), or py-spy raw files with --fold")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--fold", action="store_true")
    args = p.parse_args()
    if args.fold:
        fold([Path(a) for a in args.which])
    else:
        loop(args.which[0], args.seconds)


if __name__ == "__main__":
    main()
