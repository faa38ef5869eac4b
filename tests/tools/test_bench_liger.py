"""Liger-Kernel in ``opbuilder bench`` without Liger: the adapters against a fake functional module that
records its calls, the runner's Liger row and "vs liger" column with that fake (computing the eager
reference), and no Liger row when it is absent or the device is a CPU. The real Liger runs on the GPU
machine (benchmarks/run_bench.sh)."""

from __future__ import annotations

import builtins
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from opbuilder.tools.bench import liger, report
from opbuilder.tools.bench.runner import LIGER, Case, CaseRunner, load_ours
from opbuilder.ops.fused_add_rmsnorm import reference as eager_add_rmsnorm
from opbuilder.tools.bench.specs import LN_EPS, RMS_EPS, SPECS
from opbuilder.dispatch.timing import CpuTimer


class FakeLiger:
    """Liger's functional API, computing the references and recording each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def liger_fused_add_rms_norm(self, x, r, w, eps, offset=0.0, casting_mode="llama", in_place=True):
        self.calls.append(("fused_add_rms_norm", eps, offset, casting_mode, in_place))
        return eager_add_rmsnorm(x, r, w)

    def liger_layer_norm(self, x, w, b, eps):
        self.calls.append(("layer_norm", eps, bool((x >= 0).all())))
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    def liger_softmax(self, x):
        self.calls.append(("softmax",))
        return torch.softmax(x, -1)


def test_adapters_call_liger_as_ours_computes() -> None:
    fake = FakeLiger()
    x, r, w, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
    out, residual_out = liger.adapter("fused_add_rmsnorm", fake)(x, r, w)
    torch.testing.assert_close(residual_out, x + r)
    # Llama casting (the norm in float32, as ours), not in place (the benchmark reuses the output gradients)
    assert fake.calls[-1] == ("fused_add_rms_norm", RMS_EPS, 0.0, "llama", False)
    y = liger.adapter("fused_relu_layernorm", fake)(x, w, b)
    assert fake.calls[-1] == ("layer_norm", LN_EPS, True)  # Liger's LayerNorm gets relu(x)
    torch.testing.assert_close(y, F.layer_norm(torch.relu(x), (8,), w, b, LN_EPS))
    liger.adapter("softmax", fake)(x)
    assert fake.calls[-1] == ("softmax",)
    assert liger.adapter("relu", fake) is None and liger.adapter("fused_matmul_add_relu", fake) is None
    assert liger.adapter("softmax", None) is None
    assert set(liger.ADAPTERS) <= set(SPECS)


def test_load_needs_cuda_and_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    module, why = liger.load(torch.device("cpu"))
    assert module is None and "CUDA" in why
    real_import = builtins.__import__

    def no_liger(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if name.startswith("liger_kernel"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_liger)
    for name in [m for m in sys.modules if m.startswith("liger_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    module, why = liger.load(torch.device("cuda"))
    assert module is None and "opbuilder[liger]" in why


@pytest.mark.parametrize("backward", [False, True])
def test_runner_adds_a_checked_liger_row_and_a_vs_liger_column(backward: bool) -> None:
    fake = FakeLiger()
    runner = CaseRunner(CpuTimer(budget_ms=2, warmup_ms=1), copy_GBps=1.0, liger=fake)
    spec = SPECS["softmax"]
    ours, _, _ = load_ours(spec)
    rows = runner.run(Case(spec, (4, 32), torch.float32, "fwd+bwd" if backward else "fwd"), ours)
    by_impl = {r["impl"]: r for r in rows}
    assert LIGER in by_impl and fake.calls
    assert by_impl[LIGER]["check"] == "ok" and not by_impl[LIGER].get("error")
    assert math.isclose(by_impl["ours"]["vs_liger"], by_impl[LIGER]["us"] / by_impl["ours"]["us"], rel_tol=1e-9)
    text = report.table(rows)
    assert "vs liger" in text.splitlines()[0]
    assert report.columns(rows).index("vs liger") == report.columns(rows).index("vs compile") + 1


def test_no_liger_row_without_liger() -> None:
    runner = CaseRunner(CpuTimer(budget_ms=2, warmup_ms=1), copy_GBps=1.0)
    spec = SPECS["softmax"]
    ours, _, _ = load_ours(spec)
    rows = runner.run(Case(spec, (4, 32), torch.float32, "fwd"), ours)
    assert LIGER not in {r["impl"] for r in rows} and all(r["vs_liger"] is None for r in rows)
    assert "vs liger" not in report.table(rows)
