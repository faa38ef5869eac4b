"""Several implementations of one op: check's statuses, the trace, dispatch's choices and its fallback.

The user op (tests/helpers/dispatch_userop.py) is tiny and CPU-only; its builds land in the warm test cache.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import dispatch_userop
from helpers.dispatch_userop import USEROP_DIR
from opbuilder.dispatch import check, router as dispatch, trace
from opbuilder.errors import BuildError, FallbackWarning


def _x(rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * 1000 + width))


def _fake_times(rows: list[check.Row], us: dict[str, float]) -> list[check.Row]:
    """The rows of a real check, with times made up so that the test says which one is fastest."""
    return [replace(r, us=us[r.implementation] if r.status == "PASSED" else None) for r in rows]


@pytest.fixture(scope="module")
def two_versions() -> str:
    op = "twice_plus_one_v1v2"
    dispatch_userop.define(op, USEROP_DIR, ("v1", "v2"))
    return op


def test_check_marks_v2_incorrect_on_odd_widths(two_versions: str) -> None:
    rows = check.check(two_versions)
    status = {(r.implementation, r.workload): r.status for r in rows}
    assert {r.workload for r in rows} == {"8x64", "7x111", "4096x64", "one row", "odd widths", "empty"}
    for workload in ("7x111", "odd widths"):
        assert status["v2", workload] == "INCORRECT_NUMERICAL"
    for workload in ("8x64", "4096x64", "one row", "empty"):
        assert status["v2", workload] == "PASSED"
    assert all(status["v1", w] == "PASSED" and status["reference", w] == "PASSED" for w in ("7x111", "odd widths"))
    odd = next(r for r in rows if (r.implementation, r.workload) == ("v2", "7x111"))
    assert odd.max_abs == pytest.approx(0.25, rel=1e-3)


def test_dispatch_never_sends_odd_widths_to_v2(two_versions: str) -> None:
    rows = _fake_times(check.check(two_versions), {"v2": 1.0, "v1": 2.0, "reference": 3.0})  # v2 "fastest"
    check.save(two_versions, rows, "tune")
    op = dispatch.apply(two_versions)(dispatch_userop.reference)
    for rows_, width, want in ((8, 64, "v2"), (4096, 64, "v2"), (7, 111, "v1"), (3, 111, "v1"), (1, 5, "v1")):
        x = _x(rows_, width)
        if (rows_, width) == (3, 111) or (rows_, width) == (1, 5):
            # shapes no workload had: their buckets have no times, so the default (v1) takes them
            assert op.pick(x) == "v1"
        else:
            assert op.pick(x) == want, (rows_, width)
        torch.testing.assert_close(op(x), dispatch_userop.reference(x), rtol=0, atol=0)


def test_compile_error_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    op = "twice_plus_one_broken"
    dispatch_userop.define(op, USEROP_DIR, ("broken", "v1"))
    rows = check.check(op, names=["broken"])
    assert {r.status for r in rows} == {"COMPILE_ERROR"} and "BuildError" in rows[0].message

    fn = dispatch.apply(op)(dispatch_userop.reference)
    x = _x(7, 111)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1, y2 = fn(x), fn(x)
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert op in str(fallbacks[0].message) and "broken: BuildError" in str(fallbacks[0].message)
    assert fn.pick(x) == "v1"
    torch.testing.assert_close(y1, dispatch_userop.reference(x), rtol=0, atol=0)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)

    monkeypatch.setenv("OPB_FALLBACK", "0")
    strict = dispatch.apply(op)(dispatch_userop.reference)
    with pytest.raises(BuildError, match="twice_plus_one"):
        strict(x)


def test_a_trace_that_says_the_reference_is_fastest_for_small_shapes(two_versions: str) -> None:
    op = "twice_plus_one_small"
    dispatch_userop.define(op, USEROP_DIR, ("v1",))
    calls = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return dispatch_userop.reference(x)

    from opbuilder.dispatch import implementations

    implementations.register(op, implementations.reference(spy))
    rows = check.check(op)
    small = {"8x64", "7x111", "one row", "odd widths", "empty"}
    check.save(op, [replace(r, us=(1.0 if (r.implementation == "reference") == (r.workload in small) else 5.0))
                    for r in rows], "tune")
    fn = dispatch.apply(op)(dispatch_userop.reference)
    calls.clear()  # check ran the reference too
    fn(_x(8, 64))
    fn(_x(7, 111))
    fn(_x(4096, 64))
    assert calls == [(8, 64), (7, 111)]
    assert fn.pick(_x(4096, 64)) == "v1"


def test_trace_is_keyed_by_the_implementations(two_versions: str) -> None:
    keys = check.keys(two_versions)
    assert set(keys) == {"v1", "v2", "reference"} and keys["v1"] != keys["v2"]
    path = trace.path(two_versions, trace.key(keys))
    assert path.parent == Path(trace.path(two_versions, "x")).parent
    assert trace.key({**keys, "v2": "something else"}) != trace.key(keys)


def test_apply_with_nothing_registered_calls_the_function() -> None:
    fn = dispatch.apply("no_implementations_at_all")(dispatch_userop.reference)
    x = _x(2, 3)
    torch.testing.assert_close(fn(x), dispatch_userop.reference(x))
    assert fn.__name__ == "reference"


def test_apply_under_torch_compile_fullgraph(two_versions: str) -> None:
    """A dispatched user op whose choice is a Python function traces without a graph break."""
    op = "twice_plus_one_python"
    from opbuilder.dispatch import definitions, implementations

    definitions.register(replace(definitions.get(two_versions), name=op))
    implementations.register(op, implementations.python("fast", lambda x: x + x + 1))
    fn = dispatch.apply(op)(dispatch_userop.reference)
    compiled = torch.compile(lambda x: fn(x).sum(-1), fullgraph=True)
    x = _x(8, 64)
    torch.testing.assert_close(compiled(x), (x * 2 + 1).sum(-1))


def test_tune_stores_a_trace_that_dispatch_follows(capsys: pytest.CaptureFixture[str]) -> None:
    """The real tune (a few ms a case): a trace with a time for every row that passed, none for the others;
    the command prints it; dispatch, whatever the times, keeps odd widths away from v2."""
    from opbuilder.tools import cli

    op = "twice_plus_one_tuned"
    dispatch_userop.define(op, USEROP_DIR, ("v1", "v2"))
    assert cli.main(["tune", op, "--budget-ms", "5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["op"] == op and data["key"] == trace.key(check.keys(op)) and set(data["implementations"]) == {"v1", "v2", "reference"}
    for row in data["rows"]:
        assert (row["us"] is not None and row["us"] > 0) == (row["status"] == "PASSED"), row
        assert row["device"] == "cpu" and row["device_name"] == trace.device_name("cpu")
    fn = dispatch.apply(op)(dispatch_userop.reference)
    assert fn.pick(_x(7, 111)) != "v2" and fn.pick(_x(5, 111)) != "v2"

    assert cli.main(["check", op]) == 1  # v2 fails some workloads
    out = capsys.readouterr().out
    assert "INCORRECT_NUMERICAL" in out and "v2" in out


def test_cli_names_an_unknown_op(capsys: pytest.CaptureFixture[str]) -> None:
    from opbuilder.tools import cli

    assert cli.main(["check", "no_such_op"]) == 1
    err = capsys.readouterr().err
    assert "no op definition named 'no_such_op'" in err and "fused_add_rmsnorm" in err
    if not torch.cuda.is_available():
        assert cli.main(["check", "relu", "--device", "cuda"]) == 1
        assert "--device cuda, but this torch sees no GPU" in capsys.readouterr().err


def test_every_status_of_a_python_implementation(two_versions: str) -> None:
    """Wrong shape, wrong dtype, an exception, and the edge workloads (one row, odd widths, empty)."""
    from opbuilder.dispatch import definitions, implementations

    op = "twice_plus_one_statuses"
    definitions.register(replace(definitions.get(two_versions), name=op))
    bad = {
        "transposed": lambda x: (x * 2 + 1).t(),
        "float64": lambda x: x.double() * 2 + 1,
        "raises": lambda x: (x.view(-1, 3) * 2 + 1).view(x.shape),  # fine only where rows x width divides by 3
        "two outputs": lambda x: (x * 2 + 1, x),
        "good": lambda x: torch.addcmul(torch.ones_like(x), x, torch.full_like(x, 2.0)),
    }
    for name, fn in bad.items():
        implementations.register(op, implementations.python(name, fn))
    status = {(r.implementation, r.workload): r.status for r in check.check(op)}
    assert status["transposed", "8x64"] == "INCORRECT_SHAPE"
    assert status["transposed", "empty"] == "INCORRECT_SHAPE"  # 0x64 against 64x0
    assert status["float64", "7x111"] == "INCORRECT_DTYPE"
    assert status["raises", "8x64"] == "RUNTIME_ERROR" and status["raises", "7x111"] == "PASSED"  # 777 = 3 x 259
    assert status["two outputs", "one row"] == "INCORRECT_SHAPE"
    assert all(status["good", w] == "PASSED" for w in ("8x64", "7x111", "4096x64", "one row", "odd widths", "empty"))
