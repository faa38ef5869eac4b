"""Two-block models from opbuilder's layers and their twins from PyTorch's layers, with the sharding plans
tests/helpers/dist_dtensor.py checks and benchmarks/multi_gpu.py times.

``Model``: RMSNorm, Softmax, FusedAddRMSNorm, ReLU and a FusedReLULayerNorm head, with plain linears that
tensor parallelism can split (``sequence_parallel``). ``FFNModel``: the same blocks and FusedLinearReLU, for
data parallelism (DDP, FSDP2), where any layer works. ``exit_rank`` ends a rank's process once its process
group is destroyed.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import opbuilder.ops as ops


class AddRMSNorm(nn.Module):
    """PyTorch's twin of FusedAddRMSNorm: ``(rms_norm(x + residual), x + residual)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, residual):
        h = x + residual
        return F.rms_norm(h, (h.shape[-1],), self.weight, 1e-6), h


class Block(nn.Module):
    """norm -> mix (linear, softmax over features, linear) -> fused residual-add norm -> ReLU MLP."""

    def __init__(self, dim: int, hidden: int, fused: bool) -> None:
        super().__init__()
        self.norm1 = ops.RMSNorm(dim) if fused else nn.RMSNorm(dim, eps=1e-6)
        self.mix_in, self.mix_out = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.softmax = ops.Softmax(-1) if fused else nn.Softmax(-1)
        self.norm2 = ops.FusedAddRMSNorm(dim) if fused else AddRMSNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = ops.ReLU() if fused else nn.ReLU()

    def forward(self, x):
        a = self.mix_out(self.softmax(self.mix_in(self.norm1(x))))
        normed, x = self.norm2(a, x)
        return x + self.down(self.act(self.up(normed)))


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, fused: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, hidden, fused) for _ in range(2)])
        self.head_norm = ops.FusedReLULayerNorm(dim) if fused else nn.LayerNorm(dim)
        self.fused = fused
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.head_norm(x if self.fused else torch.relu(x)))


class FFNModel(nn.Module):
    """For FSDP2: every opbuilder layer, FusedLinearReLU included (its parameters are plain tensors in the
    forward under FSDP2, so any layer works there)."""

    def __init__(self, dim: int, hidden: int, fused: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, hidden, fused) for _ in range(2)])
        self.up = ops.FusedLinearReLU(dim, hidden) if fused else nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.down(self.up(x))


def twins(cls, dim: int, hidden: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(opbuilder model, PyTorch model) of class ``cls`` with the same weights (seeded: the same on every rank)."""
    torch.manual_seed(0)
    fused = cls(dim, hidden, True).to(device, dtype)
    plain = cls(dim, hidden, False).to(device, dtype)
    # FFNModel's top-level FusedLinearReLU is nn.Sequential(Linear, ReLU) in the twin.
    plain.load_state_dict({"up.0." + k[3:] if k.startswith("up.") else k: v for k, v in fused.state_dict().items()})
    return fused, plain


def sequence_parallel(model: Model, mesh) -> Model:
    """The standard plan: norms on sequence-sharded activations, linears column- then row-wise."""
    S1 = Shard(1)
    for block in model.blocks:
        parallelize_module(block, mesh, {
            "norm1": SequenceParallel(),
            "mix_in": ColwiseParallel(input_layouts=S1, use_local_output=False),  # softmax sees a DTensor
            "mix_out": RowwiseParallel(output_layouts=S1, use_local_output=False),
            "up": ColwiseParallel(input_layouts=S1, use_local_output=False),  # so does the ReLU
            "down": RowwiseParallel(output_layouts=S1, use_local_output=False),
        })
        # FusedAddRMSNorm takes two sequence-sharded DTensors already (SequenceParallel would keep only the
        # first input): only its weight needs replicating.
        distribute_module(block.norm2, mesh)
    parallelize_module(model, mesh, {
        "head_norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=S1, output_layouts=Replicate()),
    })
    return model


def exit_rank(code: int = 0) -> NoReturn:
    """Ends a rank's process with ``code``, right after ``dist.destroy_process_group()``, its output flushed and
    the interpreter's teardown skipped: there gloo's transport thread (pt_gloo_runloop) can abort the process
    ("terminate called without an active exception", SIGABRT; about 1 run in 40 of tests/helpers/dist_dtensor.py
    on 2 CPU ranks, after every rank had got past destroy_process_group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
