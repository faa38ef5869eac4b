"""Install-time prebuild of the built-in ops; the metadata lives in pyproject.toml.

    OPB_BUILD_OPS=1 pip install --no-build-isolation --no-cache-dir .     every op that can be built here
    OPB_BUILD_RELU=1 pip install --no-build-isolation --no-cache-dir .    only relu (fails if it cannot)
    OPB_BUILD_OPS=1 OPB_BUILD_SOFTMAX=0 pip install ...                   all but softmax

Add ``-v`` to see what was prebuilt: pip hides a build's output unless it fails. Without these
variables this is a plain Python package and torch is not imported.
"""

import sys
from pathlib import Path

from setuptools import setup

# The opbuilder being installed (not one already installed) decides what to build; importing it
# imports no torch.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from opbuilder import prebuilt  # noqa: E402


def main() -> None:
    announce = any(command in sys.argv[1:] for command in prebuilt.BUILD_COMMANDS)
    try:
        extensions = prebuilt.extensions(prebuilt.plan(announce=announce))
    except (prebuilt.PrebuildError, ValueError) as exc:  # ValueError: e.g. a malformed TORCH_CUDA_ARCH_LIST
        sys.exit(f"opbuilder: {exc}")
    if not extensions:
        setup()
        return
    setup(ext_modules=extensions, cmdclass={"build_ext": prebuilt.build_ext_class()})


main()
