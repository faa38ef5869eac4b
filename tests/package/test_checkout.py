"""A Python started inside the checkout imports the checkout's ``opbuilder/`` folder, whatever is
installed; ``opbuilder.ops`` (the top-level ``ops/`` folder, mapped by the install) must work there too."""

from __future__ import annotations

import json

from helpers import ROOT, run_python

# As after a plain `pip install .`: no editable install's finder maps opbuilder.ops to this checkout.
IMPORT_OPS_IN_CHECKOUT = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", type(f).__name__)]
import opbuilder, opbuilder.ops
from opbuilder.ops import relu
print("FILES", json.dumps([opbuilder.__file__, opbuilder.ops.__file__, relu.__module__]))
"""


def test_opbuilder_ops_imports_from_the_checkout_folder() -> None:
    result = run_python(IMPORT_OPS_IN_CHECKOUT)  # run_python starts it in the checkout's root
    assert result.returncode == 0, result.stderr[-2000:]
    package, ops, relu_module = json.loads(next(ln for ln in result.stdout.splitlines() if ln.startswith("FILES "))[6:])
    assert package == str(ROOT / "opbuilder" / "__init__.py")
    assert ops == str(ROOT / "ops" / "__init__.py")
    assert relu_module == "opbuilder.ops.relu"
