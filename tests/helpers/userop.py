"""A user's own op (on the stable ABI: it builds in about two seconds), written into a temporary folder the
way a user's project would hold it."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

BUILDER = '''
from opbuilder import OpBuilder


class AddScaleBuilder(OpBuilder):
    NAME = "add_scale"

    def sources(self):
        return ["csrc/add_scale.cpp"]

    def include_paths(self):
        return ["csrc"]
'''

HEADER = "#pragma once\nconstexpr float kScale = {scale};\n"

SOURCE = '''
#include <opbuilder/stable.h>
#include "scale.h"

namespace {{
opb::Tensor add_scale(const opb::Tensor& x) {{
  STD_TORCH_CHECK(x.scalar_type() == opb::ScalarType::Float, "add_scale: x must be float32, got ", x.scalar_type());
  opb::Tensor xc = torch::stable::contiguous(x);
  opb::Tensor y = opb::new_output(xc);
  const float* in = static_cast<const float*>(xc.data_ptr());
  float* out = static_cast<float*>(y.data_ptr());
  for (int64_t i = 0; i < xc.numel(); ++i) out[i] = in[i] * kScale + {offset};
  return y;
}}
}}  // namespace

OPB_LIBRARY(m) {{ m.def("add_scale(Tensor x) -> Tensor"); }}
OPB_LIBRARY_IMPL(CPU, m) {{ m.impl("add_scale", TORCH_BOX(&add_scale)); }}
'''


CLASSIC_SOURCE = '''
#include <opbuilder/library.h>
#include <ATen/core/Tensor.h>
#include "scale.h"

namespace {{
at::Tensor add_scale(const at::Tensor& x) {{
  TORCH_CHECK(x.scalar_type() == at::kFloat, "add_scale: x must be float32, got ", x.scalar_type());
  at::Tensor xc = x.contiguous();
  at::Tensor y = xc.new_empty(xc.sizes());
  const float* in = xc.const_data_ptr<float>();
  float* out = y.mutable_data_ptr<float>();
  for (int64_t i = 0; i < xc.numel(); ++i) out[i] = in[i] * kScale + {offset};
  return y;
}}
}}  // namespace

OPB_LIBRARY(m) {{ m.def("add_scale(Tensor x) -> Tensor"); }}
OPB_LIBRARY_IMPL(CPU, m) {{ m.impl("add_scale", &add_scale); }}
'''


def write_user_op(root: Path, scale: float = 2.0, offset: float = 1.0, broken: bool = False,
                  classic: bool = False) -> Path:
    """Write the op's builder module and sources under ``root`` (``classic``: an ATen/torch/library.h
    binding instead of the stable ABI); returns ``root``."""
    (root / "csrc").mkdir(parents=True, exist_ok=True)
    (root / "my_ops.py").write_text(BUILDER)
    (root / "csrc" / "scale.h").write_text(HEADER.format(scale=scale))
    source = (CLASSIC_SOURCE if classic else SOURCE).format(offset=offset)
    if broken:
        source = source.replace("return y;", "return y  // missing semicolon\n  int z = ;")
    (root / "csrc" / "add_scale.cpp").write_text(source)
    return root


def load_snippet(root: Path) -> str:
    """Python code that loads the op from ``root`` and checks it computes x * scale + offset."""
    return textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(root)!r})
        from my_ops import AddScaleBuilder
        ns = AddScaleBuilder().load()
        x = torch.arange(5, dtype=torch.float32)
        print("RESULT", ns.add_scale(x).tolist())
    """)


def user_op_key(root: Path) -> str:
    """The cache key of the op written under ``root``, worked out in this process."""
    sys.path.insert(0, str(root))
    try:
        from my_ops import AddScaleBuilder

        return AddScaleBuilder().key
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("my_ops", None)
