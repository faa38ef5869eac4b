"""Install-time prebuild of the built-in ops; the metadata lives in pyproject.toml.

    OPB_BUILD_OPS=1 pip install --no-build-isolation --no-cache-dir .     every op that can be built here
    OPB_BUILD_RELU=1 pip install --no-build-isolation --no-cache-dir .    only relu (fails if it cannot)
    OPB_BUILD_OPS=1 OPB_BUILD_SOFTMAX=0 pip install ...                   all but softmax

Add ``-v`` to see what was prebuilt: pip hides a build's output unless it fails. Without these
variables this is a plain Python package and torch is not imported.
"""

import importlib.util
import re
import sys
from pathlib import Path

_FIX = (
    "pip's --no-build-isolation (what prebuilding against your torch needs) builds with this environment's own "
    "setuptools, and a new virtual environment has an old one or none. Install what the build needs into it "
    f'first:\n    {sys.executable} -m pip install "setuptools>=64" wheel\nthen run the install again.'
)


def _check_build_tools() -> None:
    """Exit with the fix when setuptools is missing, older than 64, or cannot make a wheel (before 70.1
    it needs the separate ``wheel`` package, else pip stops at "invalid command 'bdist_wheel'")."""
    try:
        import setuptools
    except ImportError:
        sys.exit(f"opbuilder: setuptools is not installed in {sys.prefix}. {_FIX}")
    version = setuptools.__version__
    match = re.match(r"\d+", version)
    major = int(match.group(0)) if match else 0
    problems = [f"setuptools {version} is older than 64"] if major < 64 else []
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None and importlib.util.find_spec("wheel") is None:
        problems.append(f"the wheel package is missing (setuptools {version} needs it to build a wheel)")
    if problems:
        sys.exit(f"opbuilder: cannot build in {sys.prefix}: {'; '.join(problems)}. {_FIX}")


_check_build_tools()

from setuptools import setup  # noqa: E402

# The opbuilder being installed (not one already installed) decides what to build; importing it
# imports no torch.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from opbuilder.jit import prebuild  # noqa: E402


def main() -> None:
    announce = any(command in sys.argv[1:] for command in prebuild.BUILD_COMMANDS)
    try:
        extensions = prebuild.extensions(prebuild.plan(announce=announce))
    except (prebuild.PrebuildError, ValueError) as exc:  # ValueError: e.g. a malformed TORCH_CUDA_ARCH_LIST
        sys.exit(f"opbuilder: {exc}")
    if not extensions:
        setup()
        return
    setup(ext_modules=extensions, cmdclass={"build_ext": prebuild.build_ext_class()})


main()
