"""Timing one step: CUDA events on the GPU, a wall clock on the CPU; warm-up first, then the median of
many repeats.

On the GPU each repeat is ``[sleep kernel] start-event step end-event``. The sleep kernel keeps the GPU
busy while the host issues the step, so the events measure the device's time for the step, not the
Python that launches it (as ``triton.testing.do_bench``'s cache flush does; the baselines were taken with
it). The host's cost is reported beside it: ``host_us`` (issuing one step) and ``loop_us`` (steps back
to back, wall clock per step), which is what a caller that does nothing else would see.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

Step = Callable[[int], object]


@dataclass(frozen=True)
class Timing:
    samples_us: tuple[float, ...]
    host_us: float | None = None  # median host time to issue one step (GPU only)
    loop_us: float | None = None  # steps back to back, wall clock per step (GPU only)

    @staticmethod
    def pooled(parts: list[Timing]) -> Timing:
        """Several rounds' timings as one: all samples, the median host and loop times."""
        hosts = [p.host_us for p in parts if p.host_us is not None]
        loops = [p.loop_us for p in parts if p.loop_us is not None]
        return Timing(
            samples_us=tuple(x for p in parts for x in p.samples_us),
            host_us=statistics.median(hosts) if hosts else None,
            loop_us=statistics.median(loops) if loops else None,
        )

    def summary(self) -> dict[str, float | int | None]:
        samples = list(self.samples_us)
        q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
        return {
            "us": statistics.median(samples), "min_us": min(samples), "q1_us": q[0], "q3_us": q[2],
            "repeats": len(samples), "host_us": self.host_us, "loop_us": self.loop_us,
        }


class Timer:
    """Times ``step(i)`` for i = 0, 1, ...; ``reset(i)``, if given, runs untimed before each step.

    The caller times the implementations of a case in ``rounds`` turns (ours, eager, compile, ours, ...),
    each turn with ``budget_ms / rounds``, so a load that comes and goes on a shared machine falls on
    all of them alike."""

    device: torch.device
    rounds: int = 1

    def __init__(self, budget_ms: float, warmup_ms: float, min_repeats: int, max_repeats: int) -> None:
        self.budget_ms = budget_ms
        self.warmup_ms = warmup_ms
        self.min_repeats = min_repeats
        self.max_repeats = max_repeats

    def sync(self) -> None:
        pass

    def _warmup(self, step: Step, reset: Callable[[int], None] | None) -> tuple[float, float, int]:
        """Runs the step until ``warmup_ms`` has passed (3 times at least); returns the median
        (host issue time, full time) in us, and how many steps ran."""
        issue, full = [], []
        deadline = time.perf_counter() + self.warmup_ms / 1e3
        i = 0
        while i < 3 or time.perf_counter() < deadline:
            if reset:
                reset(i)
            self.sync()
            t0 = time.perf_counter()
            step(i)
            t1 = time.perf_counter()
            self.sync()
            t2 = time.perf_counter()
            issue.append((t1 - t0) * 1e6)
            full.append((t2 - t0) * 1e6)
            i += 1
        return statistics.median(issue), statistics.median(full), i

    def repeats_for(self, estimate_us: float) -> int:
        wanted = int(self.budget_ms / self.rounds * 1e3 / max(estimate_us, 1e-3))
        return max(self.min_repeats, min(self.max_repeats, wanted))

    def measure(self, step: Step, reset: Callable[[int], None] | None = None) -> Timing:
        raise NotImplementedError

    def cache_bytes(self) -> int:
        raise NotImplementedError

    def spare_bytes(self) -> int:
        """Memory the rotated input sets may take."""
        raise NotImplementedError


class CpuTimer(Timer):
    """Wall clock around each step; the CPU ops are synchronous."""

    device = torch.device("cpu")
    rounds = 3

    def __init__(self, budget_ms: float = 1000, warmup_ms: float = 200) -> None:
        super().__init__(budget_ms, warmup_ms, min_repeats=3, max_repeats=500)

    def measure(self, step: Step, reset: Callable[[int], None] | None = None) -> Timing:
        _, estimate, first = self._warmup(step, reset)
        samples = []
        for i in range(first, first + self.repeats_for(estimate)):
            if reset:
                reset(i)
            t0 = time.perf_counter()
            step(i)
            samples.append((time.perf_counter() - t0) * 1e6)
        return Timing(tuple(samples))

    def cache_bytes(self) -> int:
        """The last-level cache (Linux sysfs), else 32 MiB; at most 64 MiB, since a virtual machine may
        report its host's whole cache."""
        sizes = []
        for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
            text = f.read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
            digits = text.rstrip("KM")
            if digits.isdigit():
                sizes.append(int(digits) * mult)
        return min(max(sizes, default=32 << 20), 64 << 20)

    def spare_bytes(self) -> int:
        return 1 << 30


class CudaTimer(Timer):
    def __init__(self, device: torch.device, budget_ms: float = 200, warmup_ms: float = 25) -> None:
        super().__init__(budget_ms, warmup_ms, min_repeats=20, max_repeats=2000)
        self.device = device
        self.cycles_per_us = self._calibrate_sleep()

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def _calibrate_sleep(self) -> float | None:
        """Clock cycles per microsecond of ``torch.cuda._sleep``; None where torch lacks it."""
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return None
        with torch.cuda.device(self.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sleep(1000)
            cycles = 10_000_000
            start.record()
            sleep(cycles)
            end.record()
            end.synchronize()
            return cycles / (start.elapsed_time(end) * 1e3)

    def measure(self, step: Step, reset: Callable[[int], None] | None = None) -> Timing:
        with torch.cuda.device(self.device):
            host, estimate, first = self._warmup(step, reset)
            repeats = self.repeats_for(estimate)
            # Cover the host's issue time, with room to spare; capped so a slow host cannot stall the run.
            sleep_cycles = int(self.cycles_per_us * min(2 * host + 20, 20_000)) if self.cycles_per_us else 0
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for r in range(repeats):
                i = first + r
                if reset:
                    reset(i)
                if sleep_cycles:
                    torch.cuda._sleep(sleep_cycles)
                starts[r].record()
                step(i)
                ends[r].record()
            self.sync()
            samples = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

            loops = max(10, repeats)
            start_i = first + repeats
            self.sync()
            t0 = time.perf_counter()
            for i in range(start_i, start_i + loops):
                if reset:
                    reset(i)
                step(i)
            self.sync()
            loop_us = (time.perf_counter() - t0) * 1e6 / loops
        return Timing(tuple(samples), host_us=host, loop_us=loop_us)

    def cache_bytes(self) -> int:
        return getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 50 << 20)

    def spare_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0] // 4


def copy_bandwidth(timer: Timer) -> dict[str, float]:
    """A large device-to-device (or RAM-to-RAM) copy; GB/s counts the bytes read plus the bytes written."""
    device = timer.device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = min(2 << 30, free // 4)
    else:
        nbytes = 256 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    timing = Timing.pooled([timer.measure(lambda i: dst.copy_(src)) for _ in range(timer.rounds)]).summary()
    return {"bytes": 2 * nbytes, "us": timing["us"], "GBps": 2 * nbytes / timing["us"] / 1e3, "repeats": timing["repeats"]}
