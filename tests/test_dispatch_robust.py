"""Dispatch and check that cannot be fooled: a newer check overrides an older tune, check gives each
implementation its own inputs and compares infinities exactly, a default that failed a kind of shape gets
no call of that kind, traces are trusted and read as the libraries are, and a candidate that crashes or
hangs is recorded as such (issue 24, items 4-7).

The user op is tests/dispatch_userop.py's (tiny, CPU-only; its builds land in the warm test cache). Each
test uses an op name of its own, so the traces of two tests never meet.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch

import dispatch_userop
from conftest import ROOT
from opbuilder import check, dispatch, dispatch_report, trace

USEROP_DIR = ROOT / "build" / "dispatch-userop"


def _x(rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * 1000 + width))


def _older(path, seconds: float = 10.0) -> None:
    """Date a trace file ``seconds`` back, so that the other record counts as the newer one."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_newer_failed_check_overrides_an_older_tune() -> None:
    """tune picked v2 for a bucket (it passed there then); a check run after it marks v2 INCORRECT there:
    calls of that bucket never go to v2 again, and report says the same."""
    op = "twice_plus_one_recheck"
    dispatch_userop.define(op, USEROP_DIR, ("v1", "v2"))
    rows = check.check(op)
    # the tune as it was: every row passed, v2 the fastest
    tuned = [replace(r, status="PASSED", max_abs=0.0, us={"v2": 1.0, "v1": 2.0, "reference": 3.0}[r.implementation])
             for r in rows]
    _older(check.save(op, tuned, "tune"))
    check.save(op, rows, "check")  # the newer check: v2 is wrong at odd widths
    fn = dispatch.apply(op)(dispatch_userop.reference)
    x = _x(7, 111)
    assert fn.pick(x) == "v1"
    torch.testing.assert_close(fn(x), dispatch_userop.reference(x), rtol=0, atol=0)
    assert fn.pick(_x(8, 64)) == "v2"  # where the check passed v2, the tune's choice stands
    picks = dispatch_report.op_dispatch(op)["picks"]
    assert "cpu float32 numel 512..1023, width % 8 != 0" not in picks or \
        picks["cpu float32 numel 512..1023, width % 8 != 0"] != "v2", picks

    # and the other way round: a tune run after the check is the newer verdict
    time.sleep(0.01)
    check.save(op, tuned, "tune")
    dispatch.reset(op)
    assert fn.pick(x) == "v2"
