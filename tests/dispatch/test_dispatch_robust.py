"""Dispatch and check that cannot be fooled: a newer check overrides an older tune, check gives each
implementation its own inputs and compares infinities exactly, a default that failed a kind of shape gets
no call of that kind, traces are trusted and read as the libraries are, and a candidate that crashes or
hangs is recorded as such (issue 24, items 4-7).

The user op is tests/dispatch_userop.py's (tiny, CPU-only; its builds land in the warm test cache). Each
test uses an op name of its own, so the traces of two tests never meet.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import replace

import pytest
import torch

from helpers import dispatch_userop
from helpers import ROOT
from helpers.dispatch_userop import USEROP_DIR, variant
from opbuilder.dispatch import check, router as dispatch, trace
from opbuilder.tools import dispatch_report


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


def test_an_implementation_that_writes_into_its_input_is_flagged_and_fools_no_other() -> None:
    """Each implementation gets its own copies of the inputs: one that writes into x is MUTATES_INPUT (even
    though its output is right), and the correct one checked after it passes."""
    def in_place(x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2).add_(1)

    op = variant("twice_plus_one_in_place", {"in place": in_place, "good": dispatch_userop.reference})
    rows = check.check(op)
    status = {(r.implementation, r.workload): r for r in rows}
    for w in ("8x64", "7x111", "4096x64", "one row", "odd widths"):
        assert status["in place", w].status == "MUTATES_INPUT", status["in place", w]
        assert "x" in status["in place", w].message
        assert status["good", w].status == "PASSED", status["good", w]
    assert status["in place", "empty"].status == "PASSED"  # nothing to write into


def _masked_rows(shape, dtype, device, gen) -> list:
    """Random rows; row 0 entirely below the mask's threshold (the reference gives NaN there)."""
    x = torch.randn(shape, generator=gen, device=device).to(dtype)
    if x.shape[0]:
        x[0] = -5.0
    return [x]


def _masked_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log-softmax over entries >= -0.5; the others are -inf, and a row with none is NaN."""
    return torch.log_softmax(x.masked_fill(x < -0.5, float("-inf")), -1)


def test_infinities_in_the_reference_are_compared_exactly() -> None:
    """Where the reference is -inf, NaN, 0 and +inf are wrong (the tolerance there is not inf); where it
    is NaN, NaN is right."""
    def with_value(value: float):
        def impl(x: torch.Tensor) -> torch.Tensor:
            y = _masked_log_softmax(x)
            return torch.where(y == float("-inf"), torch.full_like(y, value), y)
        return impl

    op = variant("masked_log_softmax", {"exact": _masked_log_softmax, "nan": with_value(float("nan")),
                                        "zero": with_value(0.0), "+inf": with_value(float("inf"))},
                 make_inputs=_masked_rows, reference=_masked_log_softmax)
    status = {(r.implementation, r.workload): r.status for r in check.check(op)}
    for w in ("8x64", "7x111", "4096x64", "odd widths"):
        assert status["exact", w] == "PASSED", w
        for bad in ("nan", "zero", "+inf"):
            assert status[bad, w] == "INCORRECT_NUMERICAL", (bad, w)


def test_a_default_that_failed_odd_widths_gets_no_odd_width_call() -> None:
    """v2 (wrong at odd widths) is the default: odd-width calls go to v1 also at sizes no workload had;
    calls of the buckets where v2 passed every workload, and even widths of new sizes, stay with v2."""
    op = "twice_plus_one_v2_first"
    dispatch_userop.define(op, USEROP_DIR, ("v2", "v1"))
    check.save(op, check.check(op), "check")
    fn = dispatch.apply(op)(dispatch_userop.reference)
    for rows_, width, want in ((7, 111, "v1"), (3, 111, "v1"), (1, 5, "v1"), (300, 333, "v1"),
                               (8, 64, "v2"), (2, 8, "v2"), (64, 64, "v2")):
        x = _x(rows_, width)
        assert fn.pick(x) == want, (rows_, width)
        torch.testing.assert_close(fn(x), dispatch_userop.reference(x), rtol=0, atol=0)


def test_a_default_that_failed_every_workload_gets_no_call() -> None:
    op = variant("twice_plus_one_all_wrong", {"wrong": lambda x: x * 3, "good": dispatch_userop.reference})
    check.save(op, check.check(op), "check")
    fn = dispatch.apply(op)(dispatch_userop.reference)
    for x in (_x(8, 64), _x(3, 111), _x(2, 8), _x(5, 16).double(), _x(5, 16).half(), torch.randn(3)):
        assert fn.pick(x) == "good", (x.shape, x.dtype)
        torch.testing.assert_close(fn(x), dispatch_userop.reference(x), rtol=0, atol=0)


# ---- traces (item 6) ---------------------------------------------------------------------------------

def _wrong_is_fastest(op: str) -> str:
    """``op`` with a slow right implementation (the default) and a fast wrong one, and a tune trace that
    says the wrong one passed and is the fastest everywhere (what a planted trace would say)."""
    variant(op, {"right": dispatch_userop.reference, "fast wrong": lambda x: x * 3})
    rows = [replace(r, status="PASSED", us=1.0 if r.implementation == "fast wrong" else 9.0) for r in check.check(op)]
    check.save(op, rows, "tune")
    return op


def test_a_trace_in_a_folder_others_can_write_is_not_followed(fresh_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group-writable traces folder (a cache shared without OPB_TRUST_SHARED_CACHE=1): its trace could
    have been planted by another member, so dispatch ignores it (one warning naming it), as the loader
    refuses libraries there; with OPB_TRUST_SHARED_CACHE=1 it is followed."""
    op = _wrong_is_fastest("twice_plus_one_planted")
    path = trace.path(op, trace.key(check.keys(op)))
    path.parent.chmod(0o775)
    fn = dispatch.apply(op)(dispatch_userop.reference)
    x = _x(8, 64)
    with pytest.warns(UserWarning) as caught:
        assert fn.pick(x) == "right"
        torch.testing.assert_close(fn(x), dispatch_userop.reference(x), rtol=0, atol=0)
    ours = [w for w in caught if str(path) in str(w.message)]
    assert len(ours) == 1 and "writable by group" in str(ours[0].message), [str(w.message) for w in caught]

    monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", "1")
    dispatch.reset(op)
    assert fn.pick(x) == "fast wrong"


def _good_row(op: str) -> dict:
    return {"implementation": "fast wrong", "workload": "8x64", "shape": [8, 64], "dtype": "float32",
            "device": "cpu", "device_name": trace.device_name("cpu"), "bucket": [10, True], "status": "PASSED",
            "max_abs": 0.0, "max_rel": 0.0, "message": "", "us": 1.0}


BAD_ROWS = [
    {"bucket": [10]}, {"bucket": [[10], True]}, {"bucket": ["10", True]}, {"bucket": "10"}, {"bucket": None},
    {"bucket": [10, "yes"]}, {"dtype": "no_such_dtype"}, {"dtype": "Tensor"}, {"dtype": 5}, {"status": 5},
    {"us": "fast"}, {"us": [1]}, {"device": 5}, {"device": ["cpu"]}, {"implementation": ["fast wrong"]},
    {"implementation": None}, {"device_name": {"a": 1}},
]
BAD_TOPS = [[], "text", 42, None, {"rows": 5}, {"rows": [1, 2]}, {"rows": [{}]}, {"rows": None}, {"no rows": []}]


@pytest.mark.parametrize("fallback", [None, "1"])
def test_a_trace_of_the_wrong_shape_is_ignored_with_one_warning(fallback, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    if fallback is not None:
        monkeypatch.setenv("OPB_FALLBACK", fallback)
    op = _wrong_is_fastest("twice_plus_one_bad_trace")
    path = trace.path(op, trace.key(check.keys(op)))
    good = json.loads(path.read_text())
    fn = dispatch.apply(op)(dispatch_userop.reference)
    x = _x(8, 64)
    cases = [{**good, "rows": [{**_good_row(op), **bad}]} for bad in BAD_ROWS] + BAD_TOPS
    now = time.time_ns()
    for i, data in enumerate(cases):
        path.write_text(json.dumps(data))
        os.utime(path, ns=(now + i, now + i))  # a new file each time (the warning is given once a file)
        dispatch.reset(op)
        with pytest.warns(UserWarning) as caught:
            y = fn(x)
            fn(x)
        torch.testing.assert_close(y, dispatch_userop.reference(x), rtol=0, atol=0)
        ours = [w for w in caught if str(path) in str(w.message)]
        assert len(ours) == 1, (i, data, [str(w.message) for w in caught])


def test_builtin_relu_with_a_trace_of_the_wrong_shape(fresh_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in relu's first call with a broken trace: the result, one warning naming the file."""
    import json
    import shutil

    import opbuilder.ops as ops

    built = ROOT / "build" / "test-cache" / "relu"
    if built.is_dir():  # its build from the warm test cache, so that this test does not compile
        shutil.copytree(built, fresh_cache / "relu", symlinks=True, ignore=shutil.ignore_patterns("*.lock"))
    monkeypatch.setenv("OPB_FALLBACK", "1")
    path = trace.path("relu", trace.key(check.keys("relu")))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"rows": [{**_good_row("relu"), "implementation": "compiled", "bucket": [[1], 2]}]}))
    dispatch.reset("relu")
    try:
        x = torch.randn(8, 64)
        with pytest.warns(UserWarning) as caught:
            y = ops.relu(x)
        torch.testing.assert_close(y, torch.relu(x), rtol=0, atol=0)
        assert len([w for w in caught if str(path) in str(w.message)]) == 1
    finally:
        dispatch.reset("relu")


def test_a_folder_where_a_trace_goes_is_ignored_and_keeps_no_descriptor_open(fresh_cache) -> None:
    """open() of a folder's descriptor raises and leaves it open: every read leaked one."""
    op = "relu"
    k = trace.key(check.keys(op))
    trace.path(op, k).mkdir(parents=True)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.warns(UserWarning) as caught:
        for _ in range(20):
            assert trace.read(op, k) is None
            assert trace.records(op, k) == (None, [])
    assert len(os.listdir("/proc/self/fd")) == fds
    ours = [str(w.message) for w in caught if str(trace.path(op, k)) in str(w.message)]
    assert len(ours) == 1 and "not a regular file" in ours[0], [str(w.message) for w in caught]


def test_a_traces_folder_holding_only_a_lock_is_no_trace(fresh_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace write that failed after taking its key's lock (a full disk, a kill) leaves the lock file, which
    is never removed: every later process's first call then read the op's traces and worked out every
    implementation's key, for nothing. Only a trace file is a trace."""
    from opbuilder import paths
    from opbuilder.dispatch import implementations

    op, k = "relu", "0" * 20  # not check.keys(op): listing the implementations takes the op off the short road
    assert not trace.any_for(op)
    paths.traces(op).mkdir(parents=True)
    assert not trace.any_for(op)  # an empty folder
    paths.trace_lock(op, k).touch()
    assert not trace.any_for(op)
    # the first call's short road: the compiled op loaded (not built here), the table of implementations never made
    from opbuilder.torchop import lazy

    monkeypatch.setattr(lazy, "loaded", lambda name: None)
    monkeypatch.setattr(dispatch, "LISTED", set())  # as in a new process: no test before this listed relu's
    monkeypatch.setattr(implementations, "of", lambda name: pytest.fail(f"{name}'s implementations were listed"))
    monkeypatch.setattr(trace, "records", lambda *a: pytest.fail("the traces were read"))
    dispatch.reset(op)
    try:
        assert dispatch._resolve(op) is False
    finally:
        dispatch.reset(op)
    trace.path(op, k, "check").write_text("{}")
    assert trace.any_for(op)


@pytest.mark.parametrize("name", ["../../escape", "/tmp/escape", "a/b", "..", "", ".hidden"])
def test_an_op_name_that_is_not_one_folder_is_refused(fresh_cache, name: str) -> None:
    """A user op's name is its traces' folder: "../../x" read and wrote traces outside the cache."""
    from opbuilder.dispatch import definitions

    with pytest.raises(ValueError, match=r"an op's name must be one folder's name .*got " + re.escape(repr(name))):
        dispatch.apply(name)
    with pytest.raises(ValueError, match="an op's name must be one folder's name"):
        definitions.register(replace(definitions.get("relu"), name=name))
    with pytest.raises(ValueError, match="an op's name must be one folder's name"):
        trace.check_writable(name)
    assert not (fresh_cache.parent / "escape").exists() and name not in definitions._DEFINITIONS


def test_apply_with_a_keyword_argument_once_a_trace_exists() -> None:
    op = variant("twice_plus_one_keyword", {"v": dispatch_userop.reference, "w": lambda x: 2 * x + 1})
    rows = [replace(r, us=1.0 if r.implementation == "w" else 9.0) for r in check.check(op)]
    check.save(op, rows, "tune")
    fn = dispatch.apply(op)(dispatch_userop.reference)
    x = _x(8, 64)
    torch.testing.assert_close(fn(x=x), dispatch_userop.reference(x), rtol=0, atol=0)
    assert fn.pick(x=x) == "w" == fn.pick(x)


def test_traces_in_a_shared_cache_are_readable_by_the_group(fresh_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """OPB_TRUST_SHARED_CACHE=1 under umask 002: the trace and its folders are the group's to read, so a
    teammate's tune is used; without it, they are private."""
    op = variant("twice_plus_one_shared", {"v": dispatch_userop.reference})
    rows = check.check(op)
    old = os.umask(0o002)
    try:
        monkeypatch.setenv("OPB_TRUST_SHARED_CACHE", "1")
        shared = check.save(op, rows, "check")
        monkeypatch.delenv("OPB_TRUST_SHARED_CACHE")
        monkeypatch.setenv("OPB_CACHE_DIR", str(fresh_cache.parent / "private"))
        private = check.save(op, rows, "check")
    finally:
        os.umask(old)
    for folder in (shared, shared.parent, shared.parent.parent):
        assert folder.stat().st_mode & 0o040, (folder, oct(folder.stat().st_mode))
    assert shared.parent.stat().st_mode & 0o010
    for folder in (private, private.parent, private.parent.parent):
        assert not folder.stat().st_mode & 0o077, (folder, oct(folder.stat().st_mode))


# ---- a candidate that crashes or hangs (item 7) ----------------------------------------------------------

CRASHING = r'''
import ctypes, json, sys, time
import torch
sys.path.insert(0, "tests")
from helpers import dispatch_userop
from dataclasses import replace
from opbuilder.dispatch import definitions, implementations as impls
from opbuilder.tools import cli

def segfault_at_odd_widths(x):
    if x.shape[-1] % 2:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return x * 2 + 1

def hangs_at_odd_widths(x):
    if x.shape[-1] % 2:
        time.sleep(3600)
    return x * 2 + 1

def crash_when_loading():
    ctypes.string_at(0)

OP = "twice_plus_one_crashes"
definitions.register(definitions.Definition(
    name=OP, axes=("rows", "width"),
    inputs={"x": definitions.TensorSpec(("rows", "width"))}, outputs={"y": definitions.TensorSpec(("rows", "width"))},
    reference=dispatch_userop.reference,
    workloads=(definitions.Workload("8x64", (8, 64)), definitions.Workload("7x111", (7, 111))),
))
impls.register(OP, impls.python("segfault", segfault_at_odd_widths))
impls.register(OP, impls.python("hangs", hangs_at_odd_widths))
impls.register(OP, replace(impls.python("load crashes", dispatch_userop.reference), load=crash_when_loading))
impls.register(OP, impls.reference(dispatch_userop.reference))
sys.exit(cli.main(["check", OP, "--timeout", "3", "--json"]))
'''


def test_a_candidate_that_crashes_or_hangs_is_recorded_and_check_goes_on(fresh_cache) -> None:
    """A segfault and a hang at odd widths, a crash while loading: check ends (exit 1), with CRASH and
    TIMEOUT for those rows, the other rows checked, and the record stored whole."""
    import json

    from helpers import run_python

    result = run_python(CRASHING, timeout=300)
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    status = {(r["implementation"], r["workload"]): r for r in json.loads(result.stdout)}
    assert status["segfault", "7x111"]["status"] == "CRASH" and "SIGSEGV" in status["segfault", "7x111"]["message"]
    assert status["segfault", "odd widths"]["status"] == "CRASH"
    assert status["hangs", "7x111"]["status"] == "TIMEOUT" and "3 s" in status["hangs", "7x111"]["message"]
    assert status["hangs", "odd widths"]["status"] == "TIMEOUT"
    for impl in ("segfault", "hangs", "reference"):
        for w in ("8x64", "one row", "empty"):
            assert status[impl, w]["status"] == "PASSED", (impl, w, status[impl, w])
    assert {status["load crashes", w]["status"] for w in ("8x64", "7x111", "one row", "odd widths", "empty")} == {"CRASH"}
    assert "while loading" in status["load crashes", "8x64"]["message"]
    assert all(status["reference", w]["status"] == "PASSED" for w in ("7x111", "odd widths"))
    folder = fresh_cache / "traces" / "twice_plus_one_crashes"
    # the check record, whole, and its key's lock; no temporary file left
    stored, lock = sorted(folder.iterdir(), key=lambda p: p.suffix)
    assert lock.name == stored.name.replace(".check.json", ".lock"), (stored, lock)
    assert stored.name.endswith(".check.json") and len(json.loads(stored.read_text())["rows"]) == len(status)
