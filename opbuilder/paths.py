"""Where opbuilder's own files are: the package, its public headers, the built-in ops' sources, the
install-time builds, the templates of ``opbuilder new``.

Nothing here touches the disk or imports torch.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
#: Public headers for every op: ``#include <opbuilder/library.h>``.
INCLUDE_DIR = PACKAGE_DIR / "include"
#: Sources of the built-in ops: inside the package when installed as a wheel, beside it in a checkout.
KERNELS_DIR = next((p for p in (PACKAGE_DIR / "kernels", PACKAGE_DIR.parent / "kernels") if p.is_dir()), PACKAGE_DIR / "kernels")
#: Built-in ops compiled at install time (see ``opbuilder.jit.prebuilt``): ``<PREBUILT_DIR>/<op>/``.
PREBUILT_DIR = PACKAGE_DIR / "_prebuilt"
#: The skeleton ``opbuilder new`` writes.
TEMPLATE_DIR = PACKAGE_DIR / "templates" / "op"
