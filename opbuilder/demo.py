"""``./run demo``: build relu on first use, run it, and show that a second load is a cache hit."""

from __future__ import annotations

import time

import torch


def main() -> None:
    import opbuilder.ops as ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(4, 8, device=device)
    started = time.perf_counter()
    y = ops.relu(x)
    print(f"relu on {device}: first call (build or cache hit + load) took {time.perf_counter() - started:.2f} s")
    print("matches torch.relu:", bool(torch.equal(y, torch.relu(x))))


if __name__ == "__main__":
    main()
