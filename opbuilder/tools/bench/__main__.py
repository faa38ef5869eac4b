"""``python -m opbuilder.bench ...``, the same as ``opbuilder bench ...``."""

import sys

from opbuilder.tools.bench.command import main

sys.exit(main(sys.argv[1:]))
