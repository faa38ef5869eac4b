"""Dispatch under concurrency and on devices no trace covers: a ``reset`` landing in the middle of a call,
two processes writing one trace, a tensor on the meta device."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import dispatch_userop
from opbuilder.dispatch import check, router as dispatch, trace


def _x(rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * 1000 + width))


def _tuned(op: str, impls: dict, fastest: str) -> None:
    """``op``: the user op of the dispatch tests with ``impls`` (Python), a tune saved where ``fastest`` wins."""
    dispatch_userop.variant(op, impls)
    rows = [replace(r, us=1.0 if r.implementation == fastest else 9.0) for r in check.check(op)]
    check.save(op, rows, "tune")


def test_a_reset_between_a_calls_resolve_and_its_table_read_still_gives_the_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread's ``reset`` (after a new tune) can land after this call's ``resolve`` and before it reads
    the choices: the call still goes to an implementation (it returned None once), and the next one resolves."""
    op = "twice_plus_one_reset_race"
    _tuned(op, {"v": dispatch_userop.reference, "w": lambda x: 2 * x + 1}, "w")
    fn = dispatch.apply(op)(dispatch_userop.reference)
    x = _x(8, 64)
    assert fn.pick(x) == "w"
    real = dispatch.resolve

    def resolve_then_reset(name: str) -> bool:
        stays = real(name)
        dispatch.reset(name)  # the other thread's reset, at the worst moment
        return stays

    monkeypatch.setattr(dispatch, "resolve", resolve_then_reset)
    y = fn(x)
    assert y is not None
    torch.testing.assert_close(y, dispatch_userop.reference(x), rtol=0, atol=0)
    monkeypatch.setattr(dispatch, "resolve", real)
    assert dispatch.router(op).table is None  # the reset stands: the next call chooses again
    torch.testing.assert_close(fn(x), dispatch_userop.reference(x), rtol=0, atol=0)
    assert dispatch.router(op).table is not None


def test_a_tensor_on_another_device_goes_to_the_default_not_to_the_cpus_choice() -> None:
    """A trace's choices hold for the device they were timed on: a meta tensor's call (shape propagation)
    went to the CPU's choice, here an implementation that only a CPU tensor can run."""
    def through_numpy(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy() * 2 + 1)

    op = "twice_plus_one_meta"
    _tuned(op, {"v": dispatch_userop.reference, "numpy": through_numpy}, "numpy")
    fn = dispatch.apply(op)(dispatch_userop.reference)
    assert fn.pick(_x(8, 64)) == "numpy"
    meta = torch.empty(8, 64, device="meta")
    assert fn.pick(meta) == "v"
    y = fn(meta)
    assert y.device.type == "meta" and y.shape == (8, 64)
    torch.testing.assert_close(fn(_x(8, 64)), dispatch_userop.reference(_x(8, 64)), rtol=0, atol=0)


def test_two_writers_of_one_trace_keep_both_devices_rows(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tunes of one op on one cache (two nodes with different GPUs): each keeps the other device's rows,
    so the writes read and replace the file one at a time; before, the second writer's rows were lost. In a
    fresh cache: the trace a run before left in the test cache already has both rows, which the first writer
    would keep without a lock."""
    op = "twice_plus_one_two_writers"
    keys = {"v": "k1"}
    row = {"implementation": "v", "device": "cpu", "dtype": "float32", "status": "PASSED", "bucket": [9, True],
           "us": 1.0}
    first_read, second_done = threading.Event(), threading.Event()
    real_read = trace.read

    def slow_read(name: str, trace_key: str, kind: str = "tune"):
        data = real_read(name, trace_key, kind)
        if threading.current_thread().name == "first":
            first_read.set()
            second_done.wait(2.0)  # without a lock the second writer finishes here, between read and write
        return data

    monkeypatch.setattr(trace, "read", slow_read)
    first = threading.Thread(name="first",
                             target=lambda: trace.write(op, keys, [dict(row, device_name="node a")]))
    first.start()
    assert first_read.wait(30)
    trace.write(op, keys, [dict(row, device_name="node b")])
    second_done.set()
    first.join(30)
    names = sorted(r["device_name"] for r in real_read(op, trace.key(keys))["rows"])
    assert names == ["node a", "node b"]


def _reset_in_child(op: str) -> None:
    dispatch.reset(op)


def test_a_reset_in_a_process_forked_while_another_thread_resolves_does_not_hang() -> None:
    """``reset`` takes the lock that a first call holds while it resolves (loading, maybe building, for
    minutes): a process forked meanwhile (a DataLoader worker) inherits it held by a thread it does not have,
    and its reset, or its own first call, waited for ever."""
    import multiprocessing

    op = "twice_plus_one_fork_reset"
    fn = dispatch.apply(op)(dispatch_userop.reference)
    resolving, done = threading.Event(), threading.Event()

    def hold() -> None:  # another thread in the middle of a resolve
        with dispatch._LOCK:
            resolving.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert resolving.wait(30)
        for work in (_reset_in_child, fn):
            child = multiprocessing.get_context("fork").Process(
                target=work, args=(op,) if work is _reset_in_child else (_x(8, 64),))
            child.start()
            child.join(30)
            hung = child.exitcode is None
            if hung:
                child.kill()
                child.join()
            assert not hung and child.exitcode == 0, (work, child.exitcode)
    finally:
        done.set()
        holder.join()


def test_a_cache_without_file_locks_is_refused_before_a_check_or_tune_runs(
        fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``trace.write`` locks the trace's key (Lustre without flock, some NFS: LockUnsupported): the check made
    before a check or tune runs every implementation says so then, not when its rows are stored, and leaves
    nothing (not even the op's traces folder: since 6da0e77 an empty one no longer counts as a trace, so
    ``any_for`` alone would not see it)."""
    import errno
    import os

    from opbuilder.jit import locks

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(locks.fcntl, "flock", no_flock)
    op = "twice_plus_one_no_flock"
    with pytest.raises(locks.LockUnsupported, match="ENOLCK"):
        trace.check_writable(op)
    assert not trace.any_for(op)
    from opbuilder import paths

    assert not paths.traces(op).exists()
