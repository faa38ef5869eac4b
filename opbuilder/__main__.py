"""``python -m opbuilder``: the same as the ``opbuilder`` command."""

import sys

from opbuilder.cli import main

sys.exit(main())
