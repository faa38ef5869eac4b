"""Many ranks on one cache: each op missing there compiled once, different ops in parallel, and DDP
gradients equal to those of the same model built from PyTorch layers.

Two ops are missing (the least that shows two compiles at the same time), the others and the C++ gradient
glue are copied in from the run's cache: eight ranks compiling all five ops took a minute of two CPUs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import opbuilder
from helpers import ROOT, copy_builds, torchrun
from opbuilder.jit.registry import names

RANKS = 8
#: Built by the ranks (the cheapest two); every other op is in the cache they start on.
COLD = ("relu", "softmax")


@pytest.mark.slow
def test_eight_ranks_build_each_op_once(tmp_path: Path, cxx_autograd_glue: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    warm = [op for op in names() if op not in COLD]
    opbuilder.prepare(warm)  # in the run's cache (usually built there already)
    copy_builds(cxx_autograd_glue, cache, [*warm, "autograd"])
    env = dict(os.environ, OPB_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", OPB_MAX_JOBS="2")
    result = torchrun(ROOT / "tests" / "helpers" / "dist_step.py", RANKS, str(out), env=env, timeout=1800)
    assert result.returncode == 0, result.stderr[-6000:]

    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(RANKS))
    assert len({r["pid"] for r in reports}) == RANKS
    for r in reports:
        assert r["worst_relative_grad_diff"] < 1e-4, r

    manifests = {}
    for op in names():
        builds = [p for p in (cache / op).iterdir() if p.is_dir() and not p.name.startswith(".")]
        assert len(builds) == 1, f"{op}: {builds}"
        manifests[op] = json.loads((builds[0] / "manifest.json").read_text())
        if op in COLD:
            assert result.stderr.count(f"opbuilder: building {op} ") == 1, f"{op} was not built exactly once"
        else:
            assert f"opbuilder: building {op} " not in result.stderr, f"{op} was in the cache and built again"
    # Different ops were compiled at the same time, not one after another.
    spans = sorted((manifests[op]["build_started"], manifests[op]["build_started"] + manifests[op]["build_seconds"])
                   for op in COLD)
    overlaps = sum(1 for (s1, e1), (s2, _) in zip(spans, spans[1:]) if s2 < e1)
    assert overlaps >= 1, spans
