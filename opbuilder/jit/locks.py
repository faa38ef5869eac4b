"""The build locks: an OS lock (``flock``) on a file in the cache, which the kernel releases when its
holder dies, even by ``kill -9``.

Only ``EWOULDBLOCK``/``EAGAIN`` mean that another process holds the lock. Any other error of ``flock``
(``ENOSYS``, ``EOPNOTSUPP``, ``ENOLCK``, ...: Lustre mounted without ``flock``, some NFS setups) means that
locks cannot work in that folder at all: waiting would never end, so ``acquire`` fails at once with
``LockUnsupported``, naming the folder and what to do. There is no fallback to lock files that exist
while held: one left by a holder that was killed would block every later build of that key.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from types import TracebackType

from opbuilder import env
from opbuilder.jit import cache
from opbuilder.errors import CacheError

_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN)


class Timeout(Exception):
    """Another process held the lock for the whole time given."""


class LockUnsupported(CacheError):
    """``flock`` does not work on the filesystem of the lock's folder."""


def unsupported_message(path: Path, exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return (
        f"opbuilder: cannot lock {path}: flock() failed with {name} ({os.strerror(exc.errno or 0)}): the filesystem "
        f"of {path.parent} does not support file locks (Lustre mounted without -o flock, some NFS setups), so "
        f"builds there cannot be kept from overwriting each other. Point OPB_CACHE_DIR at a folder on a local disk "
        f"or a filesystem with working locks (now: {env.cache_root()}), or have this one mounted with flock support."
    )


class FileLock:
    """An exclusive ``flock`` on ``path`` (created with ``mode`` when missing, by default ``cache.lock_mode()``,
    its folder as ``cache.ensure_dir`` makes one; never opened through a symbolic link).

    ``acquire(timeout)`` raises Timeout when another process holds it that long (None: wait as long as it
    takes), LockUnsupported when locks cannot work there, CacheError when the file cannot be opened.
    Used as a context manager it waits as long as it takes.
    """

    def __init__(self, path: str | os.PathLike[str], mode: int | None = None) -> None:
        self.path = Path(path)
        self.mode = cache.lock_mode() if mode is None else mode
        self._fd: int | None = None

    def _open(self) -> int:
        cache.ensure_dir(self.path.parent)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, self.mode)
            except FileExistsError:
                return self._open_existing(flags)
            try:
                os.fchmod(fd, self.mode)  # the mode asked for, not narrowed by the umask
            except OSError:
                pass
            return fd
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                cache.refuse_symlink(self.path)
            raise cache.cache_error(self.path, exc) from exc

    def _open_existing(self, flags: int) -> int:
        try:
            return os.open(self.path, flags)
        except PermissionError:
            # A lock file another user made without the group's write bit (an older opbuilder, or another tool's
            # umask): it holds nothing, and flock takes an exclusive lock through a read-only descriptor too.
            # Not blocking: a FIFO planted there would hang a read-only open; anything but a file is refused.
            fd = os.open(self.path, (flags & ~os.O_RDWR) | os.O_RDONLY | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise PermissionError(errno.EACCES, "not a regular file", str(self.path)) from None
            return fd

    def _try(self, fd: int) -> bool:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno in _BUSY:
                    return False
                if exc.errno == errno.EBADF and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
                    # NFS emulates flock with POSIX locks, whose exclusive kind needs a descriptor open for writing.
                    raise cache.cache_error(self.path, PermissionError(errno.EACCES, "cannot be opened for writing")) from exc
                raise LockUnsupported(unsupported_message(self.path, exc)) from exc

    def acquire(self, timeout: float | None = None, poll: float = 0.05) -> None:
        if self._fd is not None:
            return
        fd = self._open()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._try(fd):
                if deadline is not None and time.monotonic() >= deadline:
                    raise Timeout(f"{self.path} is held by another process")
                time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            # Unlocked before the close: the flock belongs to the open file, which a process forked meanwhile
            # (a worker forked by another thread, no exec) shares; closing this copy alone would leave it held.
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass  # the close below still ends this copy's hold
            os.close(fd)

    def detach(self) -> int:
        """The held lock's descriptor, forgotten here without unlocking: the caller owns it (hands it to a child
        process, which then holds the lock until it exits, and closes its own copy)."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise RuntimeError(f"{self.path}: detach() of a lock not held")
        return fd

    @property
    def is_locked(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
