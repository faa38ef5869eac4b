"""Where a training step's host time goes, layer by layer, inside the step (issue 23): per-layer figures taken
in a loop of one layer disagree with the whole step's, so this times each part where it runs.

Each step (benchmarks/train_step.py's: forward, MSE loss, backward, grad = None) is issued behind a GPU sleep,
so the host never waits for the GPU. Forward: a pre- and a post-hook on every module give each module's host
time (a Block's own time is its time less its children's: the residual adds). Backward: a pre-hook and a hook
on every autograd Node give each Node's host time on the engine's thread (by Node name), and the gaps between
Nodes. The hooks cost the same a call on both sides; ours and PyTorch's models take turns, one step each, in
a shuffled order, and each figure is the median over rounds.

    python benchmarks/tuning/insitu_host.py [--device cuda|cpu] [--size 256,1024,1024] [--model FFNModel|Model]
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallel_models import FFNModel, Model, twins  # noqa: E402


def _usage(who: int) -> tuple[int, int, int]:
    u = resource.getrusage(who)
    return u.ru_minflt, u.ru_nvcsw, u.ru_nivcsw


class Probe:
    """Hooks on a model's modules; ``step`` runs one step and returns {part: host seconds}.
    clock: time.perf_counter (wall) or time.thread_time (the CPU time of the thread that runs the part)."""

    def __init__(self, model: torch.nn.Module, clock=time.perf_counter) -> None:
        self.model = model
        self.clock = clock
        self.times: dict[str, float] = defaultdict(float)
        self.stack: list[tuple[str, float]] = []
        for name, mod in model.named_modules():
            mod.register_forward_pre_hook(self._pre(name or "model"))
            mod.register_forward_hook(self._post(name or "model"))

    def _pre(self, name: str):
        def hook(_mod, _args):
            self.stack.append((name, self.clock()))
        return hook

    def _post(self, name: str):
        def hook(_mod, _args, _out):
            start_name, start = self.stack.pop()
            assert start_name == name
            spent = self.clock() - start
            self.times["fwd " + name] += spent
            if self.stack:  # the parent's own time excludes this child
                self.times["fwd " + self.stack[-1][0]] -= spent
        return hook

    def _hook_graph(self, root) -> None:
        seen, todo = set(), [root]
        state = {"last": None}

        def pre(name):
            def hook(_grad_outputs):
                now = self.clock()
                if state["last"] is not None:
                    self.times["bwd gaps between nodes"] += now - state["last"]
                state["start"] = now
            return hook

        def post(name):
            def hook(_grad_inputs, _grad_outputs):
                now = self.clock()
                self.times["bwd " + name] += now - state["start"]
                state["last"] = now
            return hook

        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_prehook(pre(node.name()))
            node.register_hook(post(node.name()))
            todo.extend(fn for fn, _ in node.next_functions)

    def step(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        self.times.clear()
        u0 = _usage(resource.RUSAGE_THREAD)
        t0 = self.clock()
        out = self.model(x)
        t1 = self.clock()
        u1 = _usage(resource.RUSAGE_THREAD)
        loss = F.mse_loss(out.float(), target)
        t2 = self.clock()
        self._hook_graph(loss.grad_fn)
        p0 = _usage(resource.RUSAGE_SELF)
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        p1 = _usage(resource.RUSAGE_SELF)
        for p in self.model.parameters():
            p.grad = None
        t5 = self.clock()
        self.times["forward (all)"] = t1 - t0
        self.times["loss"] = t2 - t1
        self.times["backward (all, wall)"] = t4 - t3
        self.times["grad = None"] = t5 - t4 if self.clock is time.perf_counter else 0.0
        # Counts, not seconds (printed x 1e6 below): the forward's minor page faults and context switches
        # (voluntary: waits, e.g. for the GIL; involuntary: preempted) on the main thread, the backward's
        # in the whole process.
        for i, what in enumerate(("minor faults", "voluntary switches", "involuntary switches")):
            self.times[f"n fwd {what}"] = (u1[i] - u0[i]) * 1e-6
            self.times[f"n bwd {what} (process)"] = (p1[i] - p0[i]) * 1e-6
        return dict(self.times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="256,1024,1024", metavar="DIM,HIDDEN,TOKENS")
    p.add_argument("--model", choices=("FFNModel", "Model"), default="FFNModel")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: time.thread_time (the running thread's CPU time)")
    p.add_argument("--gc-off", action="store_true", help="gc.freeze() and gc.disable() before the rounds")
    p.add_argument("--twice", metavar="LAYER", help="run this layer's forward twice a step, timing each call "
                   "(the first is the layer's usual call, the second finds its code and data just used)")
    args = p.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    dim, hidden, tokens = (int(v) for v in args.size.split(","))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cls = {"FFNModel": FFNModel, "Model": Model}[args.model]
    ours, theirs = twins(cls, dim, hidden, dtype, args.device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, dim, generator=g).to(args.device, dtype)
    target = torch.randn(tokens, dim, generator=g).to(args.device)
    probes = {"ours": Probe(ours, clock), "pytorch": Probe(theirs, clock)}
    if args.twice:
        for probe in probes.values():
            layer = probe.model.get_submodule(args.twice)
            forward = layer.forward

            def twice(*a, _f=forward, _p=probe, **k):
                t0 = _p.clock()
                _f(*a, **k)
                t1 = _p.clock()
                out = _f(*a, **k)
                t2 = _p.clock()
                _p.times[f"twice {args.twice}: first call"] += t1 - t0
                _p.times[f"twice {args.twice}: second call"] += t2 - t1
                return out

            layer.forward = twice
    if args.gc_off:
        gc.collect()
        gc.freeze()
        gc.disable()
    samples: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in probes}
    order = list(probes)
    rng = random.Random(0)
    for r in range(args.rounds + 3):
        rng.shuffle(order)
        for name in order:
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda._sleep(int(1e8))  # ~50 ms: the step is issued while the GPU sleeps
            times = probes[name].step(x, target)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if r >= 3:
                for k, v in times.items():
                    samples[name][k].append(v)
    keys = sorted(set(samples["ours"]) | set(samples["pytorch"]),
                  key=lambda k: (not k.endswith("(all)"), k.split()[0], k))
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{args.model} {args.size} on {dev}, {dtype}: host us per step ({args.clock} clock"
          f"{', gc off' if args.gc_off else ''}), median of {args.rounds} rounds; 'n' rows: counts per step")
    print(f"{'part':60s} {'ours':>9s} {'pytorch':>9s} {'ours-pt':>9s}")
    med = {n: {k: statistics.median(v) * 1e6 for k, v in s.items()} for n, s in samples.items()}
    for k in keys:
        a, b = med["ours"].get(k), med["pytorch"].get(k)
        fa = f"{a:9.1f}" if a is not None else " " * 9
        fb = f"{b:9.1f}" if b is not None else " " * 9
        diff = f"{(a or 0) - (b or 0):9.1f}"
        print(f"{k[:60]:60s} {fa} {fb} {diff}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
