"""Exceptions opbuilder raises; each message says what happened and what to do next."""

from __future__ import annotations


class OpBuilderError(RuntimeError):
    """Base class of every opbuilder error."""


class EnvError(OpBuilderError, ValueError):
    """An environment variable holds a value opbuilder cannot use; the message names it, what it takes and what it
    holds. A configuration error: raised to the caller, never taken as a reason to fall back or recorded as an
    implementation's verdict."""


class BuildError(OpBuilderError):
    """Compiling an op failed. The message carries the compiler's first error lines and the log's path."""


class CacheLockTimeout(OpBuilderError):
    """Another process held the op's build lock longer than OPB_LOCK_TIMEOUT."""


class CacheError(OpBuilderError):
    """The cache folder cannot be used (not writable, not ours, full)."""


class UnknownOpError(KeyError):
    """No built-in op has that name; the message lists the known names."""

    def __str__(self) -> str:  # KeyError quotes its argument; show the sentence instead
        return str(self.args[0])


class IncompatibleOpError(OpBuilderError):
    """The op cannot be built in this environment; the message lists why."""


class FallbackWarning(RuntimeWarning):
    """An op's implementation cannot be built or loaded here; its calls go to the next one (the message says
    which and why). ``OPB_FALLBACK=0`` makes this an error."""


class SourcesChanged(Exception):
    """The files a key was computed from changed before the compiler read them, or the compiler read
    headers that the key did not cover: the build sequence computes the key again and builds that
    (``opbuilder.jit.build``); a user sees it only as a BuildError when the files keep changing."""


class TraceWarning(UserWarning):
    """A trace of ``opbuilder check``/``tune`` in the cache is not used: it could have been written by someone
    else, or it is not what those commands write. The message names the file and why; calls go as with no trace."""
