"""Building several ops at once, before they are first called.

Ranks of a distributed job call ``prepare()`` at start: every rank asks for every op at the same
moment, each op's lock goes to one rank, and different ops compile in parallel instead of one after
another as the model first reaches them. ``opbuilder build`` uses the same code.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed

from opbuilder import build, cache, prebuilt
from opbuilder.builder import OpBuilder
from opbuilder.registry import get_builder, names as builtin_names


def _ensure(builder: OpBuilder, spec: build.BuildSpec | None) -> str:
    if spec is None:
        return f"a prebuilt library fits this machine, nothing to build ({prebuilt.find(builder)[0]})"
    slot = cache.Slot(spec.op, spec.key)
    if cache.check_build(slot.path)[0] is not None:
        return f"already in the cache ({slot.path})"
    started = time.time()
    path = build.ensure_built(spec)
    targets = "cpu" + (f" + cuda {','.join(spec.archs)}" if spec.with_cuda else "")
    return f"built in {time.time() - started:.1f} s ({targets}) {path}"


def prepare_each(builders: list[OpBuilder], jobs: int | None = None) -> Iterator[tuple[str, str | BaseException]]:
    """Build each op that has neither a fitting prebuilt library nor a good build in the cache,
    ``jobs`` at a time (default: all at once); yield (op, what was done or the error) as each ends.

    Each compile runs in a child process under its key's lock, so threads suffice, and another
    process building the same op is waited for rather than repeated.
    """
    # Keys are worked out here, once, not in the threads.
    plans = [(b, None if prebuilt.find(b)[0] is not None else b.build_spec()) for b in builders]
    if not plans:
        return
    with ThreadPoolExecutor(max_workers=jobs or len(plans)) as pool:
        futures = {pool.submit(_ensure, b, spec): b.name for b, spec in plans}
        for future in as_completed(futures):
            try:
                yield futures[future], future.result()
            except Exception as exc:  # handed to the caller, which reports or raises it
                yield futures[future], exc


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
