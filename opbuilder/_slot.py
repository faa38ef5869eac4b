"""Run a compiler once one of the machine's compile slots is free: ``python -I -S _slot.py COMPILER ARGS...``.

Every ninja that opbuilder starts may run as many jobs as the machine has cores, and each job goes
through this script, which takes one of N slot files (``OPB_SLOTS=<folder>:<N>``, set by
``opbuilder.compile`` for ninja) with ``flock`` and then becomes the compiler. The lock belongs to the
open file, which the compiler inherits, so it is released when the compiler ends, also when it is
killed. So the ops building at once (``build --all``, ``prepare()``, the ranks of a node sharing one
cache) share the cores: no more than N compilers run, and a build with more files to compile takes
the slots the others leave free.

Started with -I -S, it imports only the standard library; with no usable slot folder it runs the
compiler at once. Only EWOULDBLOCK/EAGAIN mean a slot is taken: any other error of ``flock`` (ENOSYS,
EOPNOTSUPP, ENOLCK: a filesystem without file locks) makes the folder unusable, said in one line on
stderr, instead of a wait that would never end. The slot setting is passed in the environment, not on
the command line, so a change of it (another core count) does not change the command ninja compares
and recompiles nothing.
"""

import errno
import fcntl
import os
import sys
import time


def _take_slot(folder: str, count: int) -> int | None:
    """The descriptor of a locked slot file, or None when the folder cannot be used."""
    start = os.getpid() % count
    while True:
        usable = False
        for i in range(count):
            try:
                fd = os.open(os.path.join(folder, f"slot.{(start + i) % count}"),
                             os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError:
                continue
            usable = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EINTR):
                    continue
                sys.stderr.write(f"opbuilder: compile slots in {folder} cannot be locked ({os.strerror(exc.errno or 0)}); "
                                 "compiling without waiting for a free core\n")
                return None
            return fd
        if not usable:
            return None
        time.sleep(0.02)


def main() -> None:
    folder, _, count = os.environ.get("OPB_SLOTS", "").rpartition(":")
    if folder and count.isdigit() and int(count) > 0:
        fd = _take_slot(folder, int(count))
        if fd is not None:
            os.set_inheritable(fd, True)
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
