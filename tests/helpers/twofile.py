"""A user's two-file op (a binding and a plain C++ kernel), on the stable ABI or the classic one,
written into a folder the way a user's project holds it. Small on purpose: it builds in seconds."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

BUILDER = '''
from opbuilder import OpBuilder


class TwoFileBuilder(OpBuilder):
    NAME = "{name}"

    def sources(self):
        return ["csrc/binding.cpp", "csrc/kernel.cpp"]
'''

STABLE_BINDING = '''
#include <opbuilder/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "kernel.h"

using torch::stable::Tensor;

Tensor {name}(const Tensor& x) {{
  STD_TORCH_CHECK(x.scalar_type() == torch::headeronly::ScalarType::Float, "{name}: x must be float32");
  Tensor xc = torch::stable::contiguous(x);
  Tensor y = torch::stable::new_empty(xc, xc.sizes());
  kernel(static_cast<const float*>(xc.data_ptr()), static_cast<float*>(y.data_ptr()), xc.numel());
  return y;
}}

OPB_LIBRARY(m) {{ m.def("{name}(Tensor x) -> Tensor"); }}
OPB_LIBRARY_IMPL(CPU, m) {{ m.impl("{name}", TORCH_BOX(&{name})); }}
'''

CLASSIC_BINDING = '''
#include <opbuilder/library.h>
#include <ATen/core/Tensor.h>

#include "kernel.h"

at::Tensor {name}(const at::Tensor& x) {{
  TORCH_CHECK(x.scalar_type() == at::kFloat, "{name}: x must be float32");
  at::Tensor xc = x.contiguous();
  at::Tensor y = xc.new_empty(xc.sizes());
  kernel(xc.const_data_ptr<float>(), y.mutable_data_ptr<float>(), xc.numel());
  return y;
}}

OPB_LIBRARY(m) {{ m.def("{name}(Tensor x) -> Tensor"); }}
OPB_LIBRARY_IMPL(CPU, m) {{ m.impl("{name}", &{name}); }}
'''

HEADER = "#pragma once\n#include <cstdint>\nvoid kernel(const float* x, float* y, int64_t n);\n"

KERNEL = '''#include "kernel.h"
{extra}
void kernel(const float* x, float* y, int64_t n) {{
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * {scale};
}}
'''


def write_op(root: Path, name: str = "two_file", abi: str = "stable", scale: str = "2") -> Path:
    """Write the op under ``root`` (builder module ``two_file_ops.py``); returns ``root``."""
    (root / "csrc").mkdir(parents=True, exist_ok=True)
    (root / "two_file_ops.py").write_text(BUILDER.format(name=name))
    binding = STABLE_BINDING if abi == "stable" else CLASSIC_BINDING
    (root / "csrc" / "binding.cpp").write_text(binding.format(name=name))
    (root / "csrc" / "kernel.h").write_text(HEADER)
    set_kernel(root, scale)
    return root


def set_kernel(root: Path, scale: str, extra: str = "") -> None:
    """Rewrite the kernel file: ``y = x * scale`` (``scale`` is C++ code, e.g. "2" or "kValue")."""
    (root / "csrc" / "kernel.cpp").write_text(KERNEL.format(scale=scale, extra=extra))


def builder(root: Path):
    """A fresh builder object of the op under ``root`` (a new object reads the files again)."""
    sys.path.insert(0, str(root))
    try:
        sys.modules.pop("two_file_ops", None)
        from two_file_ops import TwoFileBuilder

        return TwoFileBuilder()
    finally:
        sys.path.remove(str(root))
        # Unregistered, each builder finds its folder from its own code (several ops of this name coexist).
        sys.modules.pop("two_file_ops", None)


def run_snippet(root: Path, name: str = "two_file") -> str:
    """Python code that loads the op from ``root`` in a fresh process and prints its result on 0, 1, 2."""
    return textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(root)!r})
        from two_file_ops import TwoFileBuilder
        ns = TwoFileBuilder().load()
        print("RESULT", getattr(ns, {name!r})(torch.arange(3, dtype=torch.float32)).tolist())
    """)
