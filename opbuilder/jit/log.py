"""The one way opbuilder talks while it works: whole lines on stderr, ``opbuilder: ...``."""

from __future__ import annotations

import sys
import threading

_SAY_LOCK = threading.Lock()


def say(message: str) -> None:
    """One whole line on stderr: lines of builds running at once never mix."""
    with _SAY_LOCK:
        sys.stderr.write(f"opbuilder: {message}\n")
        sys.stderr.flush()
