"""Where the host time of a training step goes (issue 23): torch.profiler's CPU table of one model's steps,
ours (C++ gradient path, then the Python path) beside PyTorch's layers, and cProfile's top Python functions.

    python benchmarks/profile_step.py [--device cuda|cpu] [--model FFNModel|Model] [--size DIM,HIDDEN,TOKENS]
                                      [--rows N] [--out DIR] [--compile]

With --compile, both models are torch.compile'd whole and the Python path is left out (a compiled graph
calls the registered ops, whose Autograd kernels are the glue's C++ ones once it is built).

Writes DIR/profile_<label>.txt (the tables) and prints the head of each.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from parallel_models import FFNModel, Model, twins  # noqa: E402
from train_step import _step  # noqa: E402

from opbuilder.torchop import cxx_autograd  # noqa: E402


def _profile(label: str, model, x, target, steps: int, rows: int, out: Path) -> None:
    for _ in range(3):
        _step(model, x, target)
    if x.is_cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False) as prof:
        for _ in range(steps):
            _step(model, x, target)
        if x.is_cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    if x.is_cuda:
        # The GPU's side: kernel time per step, and any call that makes the host wait for the GPU.
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                _step(model, x, target)
            torch.cuda.synchronize()
        table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(model, x, target)
        torch.cuda.set_sync_debug_mode(0)
        syncs = sorted({str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)})
        table += f"\nhost-device synchronisations in one step: {len(syncs)}\n" + "\n".join(syncs) + "\n"
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        _step(model, x, target)
    pr.disable()
    stream = io.StringIO()
    pstats.Stats(pr, stream=stream).sort_stats("tottime").print_stats(rows)
    text = f"== {label}: torch.profiler, {steps} steps, sorted by self CPU time\n{table}\n" \
           f"== {label}: cProfile, {steps} steps, by own time\n{stream.getvalue()}"
    (out / f"profile_{label}.txt").write_text(text)
    print("\n".join(text.splitlines()[: rows + 8]), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=("FFNModel", "Model"), default="FFNModel")
    p.add_argument("--size", default="256,1024,1024", metavar="DIM,HIDDEN,TOKENS")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out", type=Path, default=Path("build/profile"),
                   help="folder for the profile_<label>.txt files (default build/profile, which git ignores)")
    p.add_argument("--compile", action="store_true", help="profile torch.compile of each whole model")
    args = p.parse_args(argv)
    dim, hidden, tokens = (int(v) for v in args.size.split(","))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cls = {"FFNModel": FFNModel, "Model": Model}[args.model]
    ours, plain = twins(cls, dim, hidden, dtype, args.device)
    x = torch.randn(tokens, dim, device=args.device, dtype=dtype)
    target = torch.randn(tokens, dim, device=args.device)
    cxx_autograd.load(wait=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compile:
        _profile("ours_compiled", torch.compile(ours), x, target, args.steps, args.rows, args.out)
        _profile("torch_compiled", torch.compile(plain), x, target, args.steps, args.rows, args.out)
        return 0
    _profile("ours_cxx", ours, x, target, args.steps, args.rows, args.out)
    with cxx_autograd.disabled():
        _profile("ours_python", ours, x, target, args.steps, args.rows, args.out)
    _profile("torch", plain, x, target, args.steps, args.rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
