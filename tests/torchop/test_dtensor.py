"""DTensor: every op on sharded inputs, and a model from opbuilder's layers under sequence parallelism and
FSDP2, on 2 and 4 CPU ranks (gloo). One launch per world size runs every check (tests/helpers/dist_dtensor.py);
the ops come from the test cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import ROOT, torchrun

# Checks tests/helpers/dist_dtensor.py runs on each rank: a launch that runs fewer has lost some.
EXPECTED_CHECKS = {2: 54, 4: 68}


@pytest.mark.parametrize("ranks", [2, 4])
def test_dtensor_ops_and_models(ranks: int, tmp_path: Path, cxx_autograd_glue: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = torchrun(ROOT / "tests" / "helpers" / "dist_dtensor.py", ranks, str(tmp_path), env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(ranks))
    for r in reports:
        assert not r["failures"], "\n".join(r["failures"])[-8000:]
        assert r["checks"] == EXPECTED_CHECKS[ranks], r["checks"]


LATE_IMPORT = r"""
import os, sys, torch
import torch.distributed as dist
import opbuilder.ops as ops

x, w = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
want = ops.rms_norm(x, w)  # loads the op (and keeps its rule) before DTensor is imported
assert "torch.distributed.tensor" not in sys.modules, "loading an op imported DTensor"

from torch.distributed.tensor import Shard, distribute_tensor  # the kept rules are registered here

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
got = ops.rms_norm(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(w, mesh, [dist.tensor.Replicate()]))
assert torch.allclose(got.full_tensor(), want), "rms_norm on a DTensor differs"
assert not any(type(f).__name__ == "_AfterImport" for f in sys.meta_path), "the import hook stayed"
dist.destroy_process_group()
print("ok")
"""


def test_rules_kept_until_dtensor_is_imported() -> None:
    """An op loaded before ``torch.distributed.tensor`` is imported does not import it (half a second), and
    its rule is registered when it is imported."""
    import socket

    from helpers import run_python

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_python(LATE_IMPORT, env={"PORT": str(port)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")


ONE_OUTPUT_USED = r"""
import os, torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from opbuilder import ops
from opbuilder.torchop import cxx_autograd

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
x, r, w = (torch.randn(*s, dtype=torch.float64) for s in ((4, 6, 8), (4, 6, 8), (8,)))
for used in ("out", "h", "both"):
    ins = [t.clone().requires_grad_() for t in (x, r, w)]
    dts = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip((x, r, w), (Shard(1), Shard(1), Replicate()))]
    for args in (ins, dts):
        out, h = ops.fused_add_rmsnorm(*args)
        loss = {"out": out.sum(), "h": (2 * h).sum(), "both": out.sum() + (2 * h).sum()}[used]
        loss.backward()
    for a, b in zip(ins, dts):
        assert (a.grad is None) == (b.grad is None) == (used == "h" and a is ins[2]), used  # no weight grad from h
        assert a.grad is None or torch.allclose(b.grad.full_tensor(), a.grad), used
print("ok", cxx_autograd.state())
dist.destroy_process_group()
"""


@pytest.mark.parametrize("cxx", ["1", "0"], ids=["cxx", "python"])
def test_fused_add_rmsnorm_with_one_output_used(cxx: str, cxx_autograd_glue: Path) -> None:
    """On DTensors, a loss of only one of fused_add_rmsnorm's two outputs: autograd hands the backward the other
    output's gradient as zeros of a plain tensor (not a DTensor), which the backward op must not be given beside
    DTensors; either gradient path, each output alone and both."""
    import socket

    from helpers import run_python

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_python(ONE_OUTPUT_USED, env={"PORT": str(port), "OPB_CXX_AUTOGRAD": cxx})
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == ["ok", {"1": "ready", "0": "off"}[cxx]], result.stdout


def test_helpers_name_what_is_wrong() -> None:
    """A misspelt argument name would silently make a weight a row tensor: it is an error instead."""
    import torch

    from opbuilder.torchop import sharding

    mul = torch.ops.aten.mul.Tensor
    with pytest.raises(ValueError, match=r"params must name tensor arguments of aten::mul \(self, other\), got"):
        sharding.rowwise(mul, params=["wieght"])
    with pytest.raises(TypeError, match="list of argument names"):
        sharding.rowwise(mul, params="other")
    with pytest.raises(ValueError, match=r"reduced must hold output indices in \[0, 0\]"):
        sharding.rowwise(mul, reduced=[1])
    with pytest.raises(ValueError, match="linear must name"):
        sharding.elementwise(mul, linear=["grad"])
    with pytest.raises(ValueError, match="sharding.matmul: aten::relu must take lhs and rhs"):
        sharding.matmul(torch.ops.aten.relu.default)
    with pytest.raises(TypeError, match="op must be an OpOverload"):
        sharding.custom(torch.ops.aten.mul, lambda *a: [])
