"""``opbuilder bench`` on the CPU: the JSON's structure and that its numbers agree with one another
(speedups are ratios of the times, GB/s follows the byte model). No timing thresholds."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from opbuilder.tools.bench import main
from opbuilder.tools.bench import report
from opbuilder.tools.bench.runner import SAME_BYTES_COPY, load_ours
from opbuilder.tools.bench.specs import SPECS, parse_dtype, parse_shape

ROWS, COLS = 64, 96  # tiny: the test checks bookkeeping, not speed


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


@pytest.fixture(scope="module")
def relu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    argv = ["relu", "--device", "cpu", "--shapes", f"{ROWS}x{COLS}", "--dtype", "fp32", "--backward",
            "--budget-ms", "20", "--json", str(out / "r.json"), "--markdown", str(out / "RESULTS.md")]
    rc = main(argv)
    return rc, json.loads((out / "r.json").read_text()), out


def test_relu_json_structure(relu_run: tuple[int, dict, Path]) -> None:
    rc, result, _ = relu_run
    assert rc == 0
    assert {"command", "env", "copy", "settings", "cost_models", "rows", "skipped"} <= result.keys()
    assert result["complete"] is True
    assert result["env"]["device"] == "cpu" and result["env"]["torch"] == torch.__version__
    assert result["copy"]["GBps"] > 0 and result["copy"]["bytes"] > 0
    assert set(result["cost_models"]["relu"]) == {"fwd", "fwd+bwd"}
    got = {(r["pass"], r["impl"]) for r in result["rows"]}
    # a memory-bound op's forward also gets a copy of its own bytes: the yardstick at that size
    assert got == {(p, i) for p in ("fwd", "fwd+bwd") for i in ("ours", "eager", "compile")} | {("fwd", SAME_BYTES_COPY)}
    for r in result["rows"]:
        assert r["op"] == "relu" and r["shape"] == [ROWS, COLS] and r["dtype"] == "float32"
        assert not r.get("error"), r
        assert r["repeats"] >= 3 and r["sets"] >= 1
        assert 0 < r["min_us"] <= r["q1_us"] <= r["us"] <= r["q3_us"]
        assert r["TFLOPs"] is None and r["flops"] is None
    ours = [r for r in result["rows"] if r["impl"] == "ours"]
    assert all(r["check"] == "ok" and r["rel_err"] <= r["tolerance"] for r in ours)


def test_relu_ratios_are_consistent(relu_run: tuple[int, dict, Path]) -> None:
    _, result, _ = relu_run
    copy = result["copy"]["GBps"]
    n = ROWS * COLS
    # relu's byte model: x and y; with the backward, grad_y and grad_x too, and 1 bit per element each way
    for mode, nbytes in (("fwd", 2 * n * 4), ("fwd+bwd", 4 * n * 4 + n // 4)):
        rows = {r["impl"]: r for r in result["rows"] if r["pass"] == mode}
        for r in rows.values():
            assert r["bytes"] == nbytes
            assert close(r["GBps"], r["bytes"] / (r["us"] * 1e-6) / 1e9)
            assert close(r["frac_copy"], r["GBps"] / copy)
            assert close(r["vs_eager"], rows["eager"]["us"] / r["us"])
            assert close(r["vs_compile"], rows["compile"]["us"] / r["us"])
            assert r["vs"].keys() == rows.keys()
            for other, ratio in r["vs"].items():
                assert close(ratio, rows[other]["us"] / r["us"])
        assert close(rows["eager"]["vs_eager"], 1.0) and close(rows["compile"]["vs_compile"], 1.0)
        assert close(rows["ours"]["vs_eager"] * rows["eager"]["vs_compile"], rows["ours"]["vs_compile"])


def test_host_rows_hold_ours_against_the_torch_call(relu_run: tuple[int, dict, Path]) -> None:
    _, result, out = relu_run
    rows = result["host"]
    assert [(r["op"], r["requires_grad"]) for r in rows] == [("relu", False), ("relu", True), ("relu", "fwd+bwd")]
    for r in rows:
        step = r["requires_grad"] == "fwd+bwd"  # a forward and backward: its own target, the Python path beside
        assert r["torch"] == "torch.relu" and r["limit"] == (2.0 if step else 2.5) and r["shape"] == [16]
        assert r["ours_us"] > 0 and r["torch_us"] > 0 and (r["python_path_us"] if step else r["floor_us"]) > 0
        assert close(r["ratio"], r["ours_us"] / r["torch_us"]) and r["within"] == (r["ratio"] <= r["limit"])
    assert "## Host time per call" in (out / "RESULTS.md").read_text()


def test_no_host_leaves_the_host_table_out(tmp_path: Path) -> None:
    rc = main(["relu", "--device", "cpu", "--shapes", "8x8", "--budget-ms", "5", "--no-host",
               "--json", str(tmp_path / "r.json")])
    assert rc == 0 and "host" not in json.loads((tmp_path / "r.json").read_text())


def test_markdown_header_and_rows(relu_run: tuple[int, dict, Path]) -> None:
    _, result, out = relu_run
    text = (out / "RESULTS.md").read_text()
    assert f"torch {torch.__version__}" in text
    assert "Copy bandwidth measured in this run" in text and result["env"]["date"] in text
    assert "## Forward" in text and "## Forward + backward" in text
    assert sum(line.startswith("| relu |") for line in text.splitlines()) == 7
    assert "read x, write y" in text  # the byte model is stated


def test_plot(relu_run: tuple[int, dict, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, result, _ = relu_run
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="pip install"):
            report.write_plot(result, tmp_path / "s.png")
    else:
        report.write_plot(result, tmp_path / "s.png")
        assert (tmp_path / "s.png").stat().st_size > 0
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
        with pytest.raises(RuntimeError, match="needs matplotlib"):
            report.write_plot(result, tmp_path / "t.png")


def test_missing_op_module_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = copy.copy(SPECS["softmax"])
    spec.module = "opbuilder.ops._no_such_op_for_bench_test"
    monkeypatch.setitem(SPECS, "softmax", spec)
    ours, why, is_error = load_ours(spec)
    assert ours is None and not is_error and "unavailable" in why
    rc = main(["softmax", "--device", "cpu", "--shapes", "8x8", "--budget-ms", "5", "--json", str(tmp_path / "s.json")])
    result = json.loads((tmp_path / "s.json").read_text())
    assert rc == 0 and result["rows"] == [] and "unavailable" in result["skipped"]["softmax"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no_such_op"], "known ops: relu"),
        (["relu", "--shapes", "64by64"], "--shapes"),
        (["relu", "--dtype", "int8"], "--dtype"),
        (["softmax", "--shapes", "4x4x4x4x4"], "nothing to run"),
        (["relu", "--json", "/no/such/folder/r.json"], "does not exist"),
    ],
)
def test_bad_command_lines(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv + ["--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_parsers() -> None:
    assert parse_shape("1x4096x4096x4096") == (1, 4096, 4096, 4096)
    assert parse_dtype("BF16") is torch.bfloat16
    for bad in ("", "0x4", "4x", "-1x4"):
        with pytest.raises(ValueError):
            parse_shape(bad)


@pytest.mark.parametrize("name", list(SPECS))
def test_specs_make_inputs_and_costs(name: str) -> None:
    """Every op's declaration works without the op: inputs, eager reference, extras, cost model, defaults."""
    spec = SPECS[name]
    for shape, dtype in spec.cuda_cases + spec.cuda_backward_cases + spec.cpu_cases:
        spec.check_shape(shape)
        assert dtype in (torch.float32, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    small = {1: (7,), 2: (5, 12), 3: (6, 8, 10), 4: (2, 6, 8, 10)}
    for rank in spec.ranks:
        shape = small[rank]
        inputs = spec.make_inputs(shape, torch.float32, torch.device("cpu"), gen)
        assert all(t.count_nonzero() == t.numel() for t in inputs)  # random, never zeros
        want = spec.eager(*inputs)
        outs = want if isinstance(want, tuple) else (want,)
        assert all(torch.isfinite(o).all() for o in outs)
        for extra, fn in spec.extras(shape).items():
            got = fn(*inputs)
            if extra != "matmul alone":
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=extra)
        fwd, bwd = spec.cost(shape, 4, False), spec.cost(shape, 4, True)
        assert (fwd.bytes or fwd.flops) > 0 and (bwd.bytes or bwd.flops) > (fwd.bytes or fwd.flops)


def test_matmul_shapes_mean_bias_kind() -> None:
    spec = SPECS["fused_matmul_add_relu"]
    gen = torch.Generator().manual_seed(0)
    lhs, rhs, bias = spec.make_inputs((2, 3, 4, 5), torch.float32, torch.device("cpu"), gen)
    assert (lhs.shape, rhs.shape, bias.shape) == ((2, 3, 4), (2, 4, 5), (2, 3, 5))
    lhs, rhs, bias = spec.make_inputs((3, 4, 5), torch.float32, torch.device("cpu"), gen)
    assert (lhs.shape, rhs.shape, bias.shape) == ((3, 4), (4, 5), (5,))
    assert spec.cost((2, 3, 4, 5), 4, False).flops == 2 * 2 * 3 * 4 * 5
    assert spec.cost((3, 4, 5), 4, True).flops == 6 * 3 * 4 * 5


def test_same_bytes_copy_moves_the_model_bytes_from_each_set() -> None:
    from opbuilder.tools.bench.runner import CaseRunner
    from opbuilder.dispatch.timing import CpuTimer

    runner = CaseRunner(CpuTimer(budget_ms=1), copy_GBps=1.0)
    sets = [(torch.zeros(3),), (torch.zeros(3),)]
    copy = runner._same_bytes_copy(1000, sets)
    first, second = copy(*sets[0]).clone(), copy(*sets[1]).clone()
    assert first.dtype == torch.uint8 and first.numel() == 500  # 500 read + 500 written
    assert not torch.equal(first, second)  # each set has its own source, as the op's inputs rotate
    assert torch.equal(copy(*sets[0]), first)


def test_copy_note_explains_a_ratio_above_one() -> None:
    rows = [{"frac_copy": 0.8}, {"frac_copy": None}]
    assert report.copy_note(rows, 30.0) == ""
    note = report.copy_note(rows + [{"frac_copy": 2.17}], 30.2)
    assert "30.2 GB/s" in note and "above 1 in 1 row" in note and "copy, same bytes" in note
