"""One training step with opbuilder's layers against the same model with PyTorch's layers (issue 23).

    python benchmarks/train_step.py [--device cpu|cuda] [--dtype bf16|fp32] [--sizes 256,1024,1024 ...]
                                    [--compile] [--graphs] [--json FILE]

A step is: forward, MSE loss against a fixed target, backward, ``grad = None`` on every parameter; the
models are benchmarks/parallel_models.py's (``FFNModel`` and ``Model``, two blocks), the two twins share
their weights. For each model and size it prints, in one run:

- step time (wall clock over a run of steps, the device synchronised at its ends), ours with the C++
  gradient path, ours with the Python path (``OPB_CXX_AUTOGRAD=0``'s), and PyTorch's; speedup = PyTorch /
  ours;
- host time per step: on CUDA the same steps issued behind a long ``torch.cuda._sleep``, so the GPU never
  holds the host back (the time to issue them); on the CPU the step time itself;
- on CUDA, the process's CPU time per step, in runs of its own taking turns with the others
  (``time.process_time``, every thread: the autograd engine runs the backward on a thread of its own), the
  device synchronised outside it: a second view of the host's work, free of what the sleep does to launches,
  where the step is host-bound (where the GPU is the bottleneck, a launch that waits for room in the queue
  may spin, and that counts too);
- with ``--compile``, the step of ``torch.compile(model)`` (the whole model), ours and PyTorch's, and ours with
  our kernels at every size (``OPB_COMPILE_INLINE_BELOW=0``; by default small calls trace the ops' definitions);
- with ``--graphs`` (CUDA), the whole step captured in a CUDA graph (forward, loss, backward; how host-bound
  training drops its host time) and replayed, ours and PyTorch's: the GPU's time per step, the host's gone;
  with ``--compile`` too, ``torch.compile(mode="reduce-overhead")`` of the whole model (Inductor's CUDA graphs),
  ours as compiled by default and with our kernels at every size.

Each round times every run once, in an order shuffled anew each round (benchmarks/paired.py); the times
columns are the median round's. A speedup or ratio is the median of its per-round ratios (the two runs of
one round are close in time, so a slow spell of the machine hits both) with a 95 % interval in brackets (from 6
rounds on; the header says what fewer cover): at
dim 256 a step is host-bound and its time wanders by 10-15 % between rounds, so a ratio is shown above or
below 1 only where its interval lies there (``--rounds`` 25 or more narrows it). A second copy of the PyTorch
model is timed alike (``control``): its speedup against the first is what two identical models differ by in
that run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired import coverage, interleave, ratio  # noqa: E402
from parallel_models import FFNModel, Model, twins  # noqa: E402

from opbuilder.torchop import cxx_autograd  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (dim, hidden, tokens): the sizes on one GPU; the CPU ones fit a 2-core machine.
SIZES = {"cuda": ["256,1024,1024", "1024,4096,8192"], "cpu": ["64,256,64", "256,1024,256"]}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    F.mse_loss(model(x).float(), target).backward()
    for p in model.parameters():
        p.grad = None


def _time_steps(model, x, target, steps: int, device: str, marked: bool = False) -> float:
    """Seconds per step, the device synchronised before and after the run; ``marked``: each step begins with
    ``torch.compiler.cudagraph_mark_step_begin()`` (Inductor's CUDA graphs)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        if marked:
            torch.compiler.cudagraph_mark_step_begin()
        _step(model, x, target)
    _sync(device)
    return (time.perf_counter() - start) / steps


def _cpu_steps(model, x, target, steps: int, device: str) -> float:
    """Seconds of the process's CPU time per step (every thread), the synchronisations left out."""
    _sync(device)
    start = time.process_time()
    for _ in range(steps):
        _step(model, x, target)
    cpu = (time.process_time() - start) / steps
    _sync(device)
    return cpu


#: Host-time runs whose GPU sleep ended before their steps were issued (their host time may hold GPU time).
_SLEEP_RAN_OUT = 0


def _host_steps(model, x, target, steps: int, device: str) -> float:
    """Seconds per step of host work on CUDA: the steps are issued behind a long sleep kernel."""
    global _SLEEP_RAN_OUT
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time at ~2 GHz: several times what issuing the steps takes
    slept = torch.cuda.Event()
    slept.record()
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, x, target)
    host = (time.perf_counter() - start) / steps
    if slept.query():  # the sleep ended before the steps were issued: the GPU may have held the host back
        _SLEEP_RAN_OUT += 1
    torch.cuda.synchronize()
    return host


def _captured(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.cuda.CUDAGraph:
    """``model``'s step (forward, loss, backward into its ``.grad``s) captured in a CUDA graph, after a warm-up
    on a side stream (tests/torchop/test_cuda_graphs.py checks that a replay computes what eager does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _step(model, x, target)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        F.mse_loss(model(x).float(), target).backward()
    return graph


def _time_replays(graph: torch.cuda.CUDAGraph, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def measure(cls, dim: int, hidden: int, tokens: int, dtype: torch.dtype, device: str, steps: int, rounds: int,
            compile_: bool, graphs: bool = False) -> dict:
    ours, plain = twins(cls, dim, hidden, dtype, device)
    control = copy.deepcopy(plain)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, dim, generator=g).to(device, dtype).requires_grad_(False)
    target = torch.randn(tokens, dim, generator=g).to(device)
    for model in (ours, plain, control):  # warm-up: builds, caches, autotuning of the libraries
        for _ in range(3):
            _step(model, x, target)
    with cxx_autograd.disabled():
        for _ in range(2):
            _step(ours, x, target)

    def python_path(fn):
        def run():
            with cxx_autograd.disabled():
                return fn()
        return run

    # Few enough steps that their kernels fit the GPU's launch queue behind the sleep (about 80 launches a
    # step here; a full queue would make the host wait for the GPU and time the GPU instead).
    host_steps = max(2, min(steps, 4))
    runs = {
        "ours": lambda: _time_steps(ours, x, target, steps, device),
        "ours_python": python_path(lambda: _time_steps(ours, x, target, steps, device)),
        "torch": lambda: _time_steps(plain, x, target, steps, device),
        "control": lambda: _time_steps(control, x, target, steps, device),
    }
    if device == "cuda":  # on the CPU the host time is the step time: the runs above
        runs.update({
            "host_ours": lambda: _host_steps(ours, x, target, host_steps, device),
            "host_ours_python": python_path(lambda: _host_steps(ours, x, target, host_steps, device)),
            "host_torch": lambda: _host_steps(plain, x, target, host_steps, device),
            "cpu_ours": lambda: _cpu_steps(ours, x, target, steps, device),
            "cpu_torch": lambda: _cpu_steps(plain, x, target, steps, device),
        })
    if compile_:
        # ours as compiled by default (small calls traced as their PyTorch definitions, which Inductor fuses:
        # opbuilder.torchop.inline), and with our kernels at every size (OPB_COMPILE_INLINE_BELOW=0 while traced)
        c_ours, c_plain = torch.compile(ours), torch.compile(plain)
        c_kernels = torch.compile(_OwnCompile(copy.deepcopy(ours)))
        for model in (c_ours, c_plain):
            for _ in range(3):
                _step(model, x, target)
        with mock.patch.dict(os.environ, {"OPB_COMPILE_INLINE_BELOW": "0"}):
            for _ in range(3):
                _step(c_kernels, x, target)
        runs["compiled_ours"] = lambda: _time_steps(c_ours, x, target, steps, device)
        runs["compiled_kernels"] = lambda: _time_steps(c_kernels, x, target, steps, device)
        runs["compiled_torch"] = lambda: _time_steps(c_plain, x, target, steps, device)
    if graphs:  # copies: a captured model's .grad tensors belong to its graph
        g_ours, g_plain = _captured(copy.deepcopy(ours), x, target), _captured(copy.deepcopy(plain), x, target)
        runs["graphed_ours"] = lambda: _time_replays(g_ours, steps)
        runs["graphed_torch"] = lambda: _time_replays(g_plain, steps)
    if graphs and compile_:
        ro_ours, ro_plain = (torch.compile(_OwnGraphs(copy.deepcopy(m)), mode="reduce-overhead") for m in (ours, plain))
        ro_kernels = torch.compile(_OwnGraphsKernels(copy.deepcopy(ours)), mode="reduce-overhead")
        for model in (ro_ours, ro_plain):
            _time_steps(model, x, target, 3, device, marked=True)
        with mock.patch.dict(os.environ, {"OPB_COMPILE_INLINE_BELOW": "0"}):
            _time_steps(ro_kernels, x, target, 3, device, marked=True)
        runs["compiled_graphs_ours"] = lambda: _time_steps(ro_ours, x, target, steps, device, marked=True)
        runs["compiled_graphs_kernels"] = lambda: _time_steps(ro_kernels, x, target, steps, device, marked=True)
        runs["compiled_graphs_torch"] = lambda: _time_steps(ro_plain, x, target, steps, device, marked=True)
    ran_out = _SLEEP_RAN_OUT
    times = interleave(runs, rounds)
    if device != "cuda":  # on the CPU the host time is the step time
        times.update(host_ours=times["ours"], host_ours_python=times["ours_python"], host_torch=times["torch"])
    row = {"model": cls.__name__, "dim": dim, "hidden": hidden, "tokens": tokens, "device": device,
           "dtype": str(dtype).removeprefix("torch."), "glue": cxx_autograd.state(), "rounds": rounds,
           "host_sleep_ran_out": _SLEEP_RAN_OUT - ran_out,
           **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
           **{f"best_{k}_ms": min(v) * 1e3 for k, v in times.items()}}
    # name: (numerator, denominator) of each per-round ratio: speedups are PyTorch's time over ours
    pairs = {"speedup": ("torch", "ours"), "control_speedup": ("torch", "control"),
             "speedup_python_path": ("torch", "ours_python"), "host_ratio": ("host_ours", "host_torch"),
             "host_ratio_python_path": ("host_ours_python", "host_torch")}
    if device == "cuda":
        pairs["cpu_ratio"] = ("cpu_ours", "cpu_torch")
    if compile_:
        pairs.update(compiled_speedup=("compiled_torch", "compiled_ours"),
                     compiled_kernels_speedup=("compiled_torch", "compiled_kernels"))
    if graphs:
        pairs["graphed_speedup"] = ("graphed_torch", "graphed_ours")
    if graphs and compile_:
        pairs.update(compiled_graphs_speedup=("compiled_graphs_torch", "compiled_graphs_ours"),
                     compiled_graphs_kernels_speedup=("compiled_graphs_torch", "compiled_graphs_kernels"))
    for name, (num, den) in pairs.items():
        row[name], row[f"{name}_low"], row[f"{name}_high"] = ratio(times[num], times[den])
    return row


class _OwnCompile(torch.nn.Module):
    """``model`` under a forward of another code object: Dynamo caches a module's compile by its code (a copy
    of a compiled model reuses the copy's graph), and this one is traced anew, with the environment of then."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _OwnGraphs(_OwnCompile):
    """As ``_OwnCompile``, a code object of its own: the reduce-overhead compile's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _OwnGraphsKernels(_OwnCompile):
    """The reduce-overhead compile with our kernels at every size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _interval(r: dict, name: str) -> str:
    if name not in r:
        return "-"
    return f"{r[name]:.2f} [{r[name + '_low']:.2f}, {r[name + '_high']:.2f}]"


def table(rows: list[dict]) -> str:
    head = ("model", "dim", "tokens", "ours ms", "py-path ms", "torch ms", "speedup", "control",
            "host ours/torch", "host py-path/torch", "host CPU ours/torch", "compiled speedup",
            "compiled, our kernels at every size", "CUDA graph speedup", "reduce-overhead speedup",
            "reduce-overhead, our kernels at every size")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join([
            r["model"], str(r["dim"]), str(r["tokens"]), f"{r['ours_ms']:.3f}", f"{r['ours_python_ms']:.3f}",
            f"{r['torch_ms']:.3f}", *(_interval(r, name) for name in (
                "speedup", "control_speedup", "host_ratio", "host_ratio_python_path", "cpu_ratio",
                "compiled_speedup", "compiled_kernels_speedup", "graphed_speedup",
                "compiled_graphs_speedup", "compiled_graphs_kernels_speedup"))]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--sizes", nargs="*", metavar="DIM,HIDDEN,TOKENS", help="default: " + str(SIZES))
    p.add_argument("--models", nargs="*", default=["FFNModel", "Model"], choices=["FFNModel", "Model"])
    p.add_argument("--steps", type=int, default=20, help="steps per timed run (default 20)")
    p.add_argument("--rounds", type=int, default=9, help="rounds (default 9); each times every run once, in a shuffled order")
    p.add_argument("--threads", type=int, help="torch.set_num_threads on the CPU")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the whole model")
    p.add_argument("--graphs", action="store_true", help="also time the whole step captured in a CUDA graph (CUDA)")
    p.add_argument("--json", type=Path, metavar="FILE")
    args = p.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected 1 or more, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but this torch sees no GPU")
    if args.graphs and args.device != "cuda":
        p.error(f"--graphs: CUDA graphs need --device cuda, got --device {args.device}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    sizes = []
    for text in args.sizes or SIZES[args.device]:
        try:
            dim, hidden, tokens = (int(v) for v in text.split(","))
        except ValueError:
            p.error(f"--sizes takes DIM,HIDDEN,TOKENS, got {text!r}")
        sizes.append((dim, hidden, tokens))
    cxx_autograd.load(wait=True)
    rows = []
    for dim, hidden, tokens in sizes:
        for name in args.models:
            cls = {"FFNModel": FFNModel, "Model": Model}[name]
            rows.append(measure(cls, dim, hidden, tokens, dtype, args.device, args.steps, args.rounds, args.compile,
                                args.graphs))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nTraining step, {device}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, "
          f"C++ gradient path: {cxx_autograd.state()} ({args.rounds} rounds of {args.steps} steps; times: the "
          f"median round's; ratios: the median of the rounds' ratios, in brackets its {coverage(args.rounds) * 100:.0f} % interval; "
          f"control: a "
          f"copy of the PyTorch model against it):")
    print(table(rows))
    for r in rows:
        if r["host_sleep_ran_out"]:
            print(f"{r['model']} dim {r['dim']}: in {r['host_sleep_ran_out']} of its host-time runs the GPU sleep ended "
                  "before the steps were issued; its host ratios may hold GPU time")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
