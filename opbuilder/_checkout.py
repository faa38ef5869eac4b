"""``opbuilder.ops`` from a source checkout, where ``ops/`` sits beside ``opbuilder/`` and not in it.

An install maps the checkout's ``ops/`` folder to ``opbuilder.ops`` (pyproject's ``package-dir``). A
Python started inside the checkout imports the checkout's ``opbuilder/`` folder first (the current
folder leads ``sys.path``), whatever is installed; ``opbuilder.ops`` must then be the checkout's too.
This finder maps that one name, and only when nothing earlier on ``sys.meta_path`` (an editable
install's own finder, for one) found it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

#: Packages an install maps from folders outside ``opbuilder/``: name -> folder in a checkout.
MAPPED = {"opbuilder.ops": Path(__file__).resolve().parent.parent / "ops"}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = MAPPED.get(fullname)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def install() -> None:
    """Append the finder once: last, so that an installed package's own mapping wins."""
    if not any(isinstance(finder, CheckoutFinder) for finder in sys.meta_path):
        sys.meta_path.append(CheckoutFinder())
