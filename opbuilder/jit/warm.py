"""Building several ops at once, before they are first called.

Ranks of a distributed job call ``prepare()`` at start: every rank asks for every op at the same
moment, each op's lock goes to one rank, and different ops compile in parallel instead of one after
another as the model first reaches them. ``opbuilder build`` uses the same code.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed

from opbuilder.jit import build, compile
from opbuilder.jit.builder import OpBuilder
from opbuilder.jit.registry import get_builder, names as builtin_names


#: What ``prepare_each`` yields for an op it compiled (the build itself printed its lines).
BUILT = "built"


def _ensure(spec: build.BuildSpec) -> str:
    """What was done; a build prints its own lines (``opbuilder.jit.build``), so it returns "built"."""
    ready = build.build_and_load(spec, load=False)
    if ready.how == "prebuilt":
        return f"a prebuilt library fits this machine, nothing to build ({ready.path})"
    if ready.how == "cached":
        return f"already in the cache ({ready.path})"
    return BUILT


def prepare_each(builders: list[OpBuilder], jobs: int | None = None) -> Iterator[tuple[str, str | BaseException]]:
    """Build each op that has neither a fitting prebuilt library nor a good build in the cache,
    ``jobs`` at a time (default: all at once); yield (op, what was done or the error) as each ends.

    Each compile runs in a child process under its key's lock, so threads suffice, and another
    process building the same op is waited for rather than repeated.
    """
    # Keys are worked out here, once, not in the threads.
    specs = [b.build_spec() for b in builders]
    if not specs:
        return
    pool = ThreadPoolExecutor(max_workers=jobs or len(specs))
    try:
        futures = {pool.submit(_ensure, spec): spec.op for spec in specs}
        for future in as_completed(futures):
            try:
                yield futures[future], future.result()
            except Exception as exc:  # handed to the caller, which reports or raises it
                yield futures[future], exc
    except BaseException:
        # Ctrl-C, SIGTERM made an exception, or the caller stopped early: start nothing new, end the
        # running compilers; nothing half-built is published.
        pool.shutdown(wait=False, cancel_futures=True)
        compile.cancel_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        compile.reset_cancel()


def prepare(ops: Iterable[str] | None = None, jobs: int | None = None) -> dict[str, str]:
    """Make sure each op (default: every compatible built-in op) can be loaded without compiling,
    building the missing ones in parallel. Loads nothing. Returns op -> what was done.

    Raises the first failure (BuildError, CacheError, ...) once every build has ended.
    """
    wanted = list(ops) if ops is not None else [n for n in builtin_names() if get_builder(n).is_compatible()]
    done, errors = {}, []
    for op, outcome in prepare_each([get_builder(name) for name in wanted], jobs):
        if isinstance(outcome, BaseException):
            errors.append(outcome)
        else:
            done[op] = outcome
    if errors:
        raise errors[0]
    return done
