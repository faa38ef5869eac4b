"""One DDP training step per rank (run by tests/torchop/test_distributed.py through torch.distributed.run).

Every rank starts on the same empty cache, calls ``opbuilder.prepare()``, then takes one DDP step of
the opbuilder model and of the same model built from PyTorch layers, and compares the gradients.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import opbuilder
from opbuilder.tools.demo import twin_models

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from parallel_models import exit_rank  # noqa: E402  (benchmarks/ is no package)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    opbuilder.prepare()
    fused, plain = twin_models("cpu", dim=32)
    fused, plain = DDP(fused), DDP(plain)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of the batch
    x, y = torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen)
    for model in (fused, plain):
        torch.nn.functional.mse_loss(model(x), y).backward()
    worst = max(
        float((a.grad - b.grad).abs().max() / (b.grad.abs().max() + 1e-12))
        for (_, a), (_, b) in zip(fused.module.named_parameters(), plain.module.named_parameters())
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "worst_relative_grad_diff": worst, "pid": os.getpid()}, fh)
    dist.barrier()
    dist.destroy_process_group()
    exit_rank(0)


if __name__ == "__main__":
    main(sys.argv[1])
