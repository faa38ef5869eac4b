"""benchmarks/multi_gpu.py through torchrun on an empty cache: each op built once, and under DDP, FSDP2 and
tensor + sequence parallelism the loss and gradients of opbuilder's model equal those of PyTorch's. Two CPU
ranks (gloo) here; every visible GPU (NCCL) on a machine with two or more. Timings are not asserted.

The cache starts with the run's C++ gradient glue (which the benchmark loads before its timed steps, as a
job that has run once has it; tests/torchop/test_cxx_autograd.py tests its build) and with the ops but two
(``COLD``), which the benchmark must report as found, not built: the ranks build two ops at once, each once
(eight ranks build them in tests/torchop/test_distributed.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import opbuilder
from helpers import ROOT, copy_builds, torchrun
from opbuilder.jit.registry import names

PLANS = ("DDP", "FSDP2", "TP+SP")
#: Built by the ranks (the cheapest two); every other op is in the cache they start on.
COLD = ("relu", "softmax")


def run_benchmark(tmp_path: Path, run_cache: Path, ranks: int, *args: str) -> dict:
    out = tmp_path / "multi_gpu.json"
    warm = [op for op in names() if op not in COLD]
    opbuilder.prepare(warm)  # in the run's cache (usually built there already)
    copy_builds(run_cache, tmp_path / "cache", [*warm, "autograd"])
    # PYTHONPATH: opbuilder from this checkout in every rank, installed or not.
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OPB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    result = torchrun(ROOT / "benchmarks" / "multi_gpu.py", ranks, "--steps", "2", "--rounds", "1", "--warmup", "1",
                      "--json", str(out), *args, env=env, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(out.read_text())


def assert_checks_pass(report: dict, ranks: int) -> None:
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["ok"]]
    assert not failed, "\n".join(failed)
    assert report["ok"] and report["world_size"] == ranks
    for op in names():
        b = report["builds"][op]
        want = (1, 1, True) if op in COLD else (0, 0, False)  # built once by one rank, or found in the cache
        assert (b["builds"], b["new_folders"], b["cold_cache"]) == want, f"{op}: {b}"
        assert len(b["first_call_s"]) == ranks
    checked = {c["name"] for c in report["checks"]}
    for plan in PLANS:
        assert f"{plan} loss" in checked, f"{plan}: no loss check"
        assert sum(name.startswith(f"{plan} grad ") for name in checked) >= 10, f"{plan}: gradient checks missing"
        assert set(report["steps_per_s"][plan]) >= {"ours", "pytorch", "ratio"}


@pytest.mark.slow
def test_two_cpu_ranks_gloo(tmp_path: Path, cxx_autograd_glue: Path) -> None:
    report = run_benchmark(tmp_path, cxx_autograd_glue, 2, "--device", "cpu", "--backend", "gloo", "--dim", "32",
                           "--hidden", "64", "--seq", "16")
    assert_checks_pass(report, 2)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs: run on a multi-GPU machine")
def test_every_gpu_nccl(tmp_path: Path, cxx_autograd_glue: Path) -> None:
    ranks = min(torch.cuda.device_count(), 8)
    report = run_benchmark(tmp_path, cxx_autograd_glue, ranks, "--device", "cuda", "--backend", "nccl", "--seq", "256")
    assert_checks_pass(report, ranks)
