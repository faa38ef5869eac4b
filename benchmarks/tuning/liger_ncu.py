"""add+RMSNorm at 128 x 4096 bf16, ours and Liger's kernel, each called a few times so that ncu can read one
launch of each (issue 23, item 4: the case still behind Liger).

    ncu --kernel-name regex:'forward|rms' --launch-skip 3 --launch-count 1 ... python benchmarks/tuning/liger_ncu.py ours
"""

from __future__ import annotations

import sys

import torch

import opbuilder.ops as ops

which = sys.argv[1] if len(sys.argv) > 1 else "ours"
x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
r = torch.randn_like(x)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
if which == "ours":
    fn = lambda: ops.fused_add_rmsnorm(x, r, w, 1e-6)  # noqa: E731
else:
    from liger_kernel.transformers.functional import liger_fused_add_rms_norm

    fn = lambda: liger_fused_add_rms_norm(x, r, w, 1e-6, 0.0, "llama", False)  # noqa: E731
for _ in range(6):
    fn()
torch.cuda.synchronize()
print(which, "done")
