"""A user's op with several versions, for the dispatch tests: ``y = 2 x + 1`` on [rows, width] float32,
as a v1 kernel, a v2 that is wrong where the width is odd, and a version whose source does not compile.

Written under build/ (not a temporary folder) so that a second test run finds the builds in the warm
test cache: the cache key hashes the sources, and these never change between runs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import torch

from helpers import ROOT
from opbuilder.dispatch import definitions
from opbuilder.dispatch import implementations as impls

#: Where the dispatch tests write the op (see above).
USEROP_DIR = ROOT / "build" / "dispatch-userop"

BUILDERS = '''
from opbuilder import OpBuilder


class V1(OpBuilder):
    NAME = "twice_plus_one"

    def sources(self):
        return ["v1.cpp"]


class V2(OpBuilder):
    NAME = "twice_plus_one"

    def sources(self):
        return ["v2.cpp"]


class Broken(OpBuilder):
    NAME = "twice_plus_one"

    def sources(self):
        return ["broken.cpp"]
'''

# On the LibTorch stable ABI: a binding that compiles in about two seconds (the dispatch tests are not about
# the binding's kind).
SOURCE = '''
#include <opbuilder/stable.h>

namespace {{
opb::Tensor twice_plus_one(const opb::Tensor& x) {{
  STD_TORCH_CHECK(x.dim() == 2 && x.scalar_type() == opb::ScalarType::Float, "twice_plus_one: x must be 2-D float32");
  opb::Tensor xc = torch::stable::contiguous(x);
  opb::Tensor y = opb::new_output(xc);
  const float* in = static_cast<const float*>(xc.data_ptr());
  float* out = static_cast<float*>(y.data_ptr());
  const int64_t width = xc.size(1);
  for (int64_t i = 0; i < xc.numel(); ++i) out[i] = in[i] * 2.0f + 1.0f{bug};
  return y;
}}
}}  // namespace

OPB_LIBRARY(m) {{ m.def("twice_plus_one(Tensor x) -> Tensor"); }}
OPB_LIBRARY_IMPL(CPU, m) {{ m.impl("twice_plus_one", TORCH_BOX(&twice_plus_one)); }}
'''


def reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def write(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    files = {
        "userop_builders.py": BUILDERS,
        "v1.cpp": SOURCE.format(bug=""),
        "v2.cpp": SOURCE.format(bug=" + (width % 2 ? 0.25f : 0.0f)"),  # the bug: odd widths are off
        # The first line fails (a fatal error, so the compiler stops at once rather than parsing torch's headers first).
        "broken.cpp": '#include "not_written_yet.h"\n' + SOURCE.format(bug=""),
    }
    for name, text in files.items():
        path = root / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return root


def builders(root: Path):
    spec = importlib.util.spec_from_file_location("userop_builders", write(root) / "userop_builders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def define(op: str, root: Path, versions: tuple[str, ...]) -> None:
    """Register the op ``op`` (a definition and the named versions, in order, then the reference)."""
    module = builders(root)
    definitions.register(definitions.Definition(
        name=op,
        axes=("rows", "width"),
        inputs={"x": definitions.TensorSpec(("rows", "width"))},
        outputs={"y": definitions.TensorSpec(("rows", "width"))},
        reference=reference,
        workloads=(
            definitions.Workload("8x64", (8, 64)),
            definitions.Workload("7x111", (7, 111)),
            definitions.Workload("4096x64", (4096, 64)),
        ),
    ))
    classes = {"v1": module.V1, "v2": module.V2, "broken": module.Broken}
    for name in versions:
        impls.register(op, impls.compiled(name, classes[name](), "twice_plus_one"))
    impls.register(op, impls.reference(reference))


def variant(op: str, implementations: dict, make_inputs=None, reference=None) -> str:
    """``op``: the user op's definition (its workloads and edges) with Python implementations, in order."""
    base = definitions.get("twice_plus_one_v1v2") if "twice_plus_one_v1v2" in definitions._DEFINITIONS else None
    if base is None:
        define("twice_plus_one_v1v2", USEROP_DIR, ("v1", "v2"))
        base = definitions.get("twice_plus_one_v1v2")
    changes = {"name": op}
    if make_inputs is not None:
        changes["make_inputs"] = make_inputs
    if reference is not None:
        changes["reference"] = reference
    definitions.register(replace(base, **changes))
    for name, fn in implementations.items():
        impls.register(op, impls.python(name, fn))
    return op
