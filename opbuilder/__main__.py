"""``python -m opbuilder``: the same as the ``opbuilder`` command."""

import sys

from opbuilder.tools.cli import main

sys.exit(main())
