"""CI: a stable-ABI op built under one torch loads, and matches torch.relu, under another.

    python .ci/cross_torch.py build RECORD.json   # build relu here (OPB_CACHE_DIR), record its library
    python .ci/cross_torch.py load RECORD.json    # load that very library into this torch and compare

Run from the checkout's root (PYTHONPATH=.) by ``.ci/run`` with two torch installs: the default one and a
torch 2.13 CPU wheel in a virtual environment of its own, each way round.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def build(record: Path) -> None:
    import torch

    from opbuilder import cache, registry

    builder = registry.get_builder("relu")
    if builder.abi() != "stable":
        raise SystemExit(f"cross_torch: relu is expected on the stable ABI, its builder says {builder.abi()!r}")
    builder.load()
    artifact, manifest, why = cache.check_build(cache.Slot("relu", builder.key).path)
    if artifact is None or manifest is None:
        raise SystemExit(f"cross_torch: relu's build is not in the cache: {why}")
    record.write_text(json.dumps({"artifact": str(artifact), "namespace": manifest["namespace"],
                                  "torch": torch.__version__, "abi": manifest["inputs"]["abi"]}))
    print(f"cross_torch: built relu under torch {torch.__version__} ({manifest['inputs']['abi']}): {artifact}")


def load(record: Path) -> None:
    import torch

    built = json.loads(record.read_text())
    torch.ops.load_library(built["artifact"])
    relu = getattr(torch.ops, built["namespace"]).relu
    generator = torch.Generator().manual_seed(0)
    for shape in ((1,), (7, 111), (4, 4095), (0, 16)):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            x = torch.randn(shape, generator=generator).to(dtype)
            torch.testing.assert_close(relu(x), torch.relu(x), rtol=0, atol=0)  # relu is exact in every dtype
    print(f"cross_torch: relu built under torch {built['torch']} loads and matches torch.relu under {torch.__version__}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("build", "load"):
        raise SystemExit("usage: python .ci/cross_torch.py build|load RECORD.json")
    (build if sys.argv[1] == "build" else load)(Path(sys.argv[2]))
