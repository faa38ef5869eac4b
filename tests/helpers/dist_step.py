"""One DDP training step per rank (run by tests/torchop/test_distributed.py through torch.distributed.run).

Every rank starts on the same empty cache, calls ``opbuilder.prepare()``, then takes one DDP step of
the opbuilder model and of the same model built from PyTorch layers, and compares the gradients.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import opbuilder
from opbuilder.tools.demo import twin_models


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
    # DDP's reducers hold the process group and gloo's work: freed here, before the group is destroyed,
    # not during interpreter exit (where gloo's threads can meet a half-torn-down interpreter: SIGABRT).
    del fused, plain
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    # The interpreter's teardown is skipped: there gloo's transport thread (pt_gloo_runloop) can abort the
    # process after the group is destroyed ("terminate called without an active exception", SIGABRT; seen
    # in about 1 run of 40 on 2 CPU ranks, after every rank had printed past destroy_process_group).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
