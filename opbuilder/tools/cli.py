"""The ``opbuilder`` command: report, build, clean, new, bench, check, tune.

Each subcommand imports what it needs when it runs, so ``opbuilder --help`` imports no torch.
Exit codes: 0 success, 1 a build or an op failed, 2 a usage error.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path

USAGE_ERROR = 2
_KEY = re.compile(r"[0-9a-f]{20}")  # fingerprint.cache_key's form
_WORK = re.compile(r"[0-9a-f]{16}")  # compile.work_dir's form


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opbuilder",
        description="Build C++/CUDA ops for PyTorch on first use, into a content-addressed cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    report = sub.add_parser("report", help="what works on this machine and why not; what the cache holds")
    report.add_argument("--json", action="store_true", help="print JSON for tools")

    build = sub.add_parser("build", help="compile ops into the cache now (a container step, or once per node)")
    build.add_argument("ops", nargs="*", metavar="OP", help="built-in ops to build")
    build.add_argument("--all", action="store_true", help="every built-in op that can be built here")
    build.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                       help="ops built at once (default: by the cores; each build also compiles in parallel)")

    clean = sub.add_parser("clean", help="remove cached builds (never one another process is building)")
    clean.add_argument("ops", nargs="*", metavar="OP", help="ops to clean (default: every op in the cache)")
    clean.add_argument("--stale", action="store_true",
                       help="only builds that can no longer load here (another torch, Python, compiler, CPU, sources)")
    clean.add_argument("--remote", action="store_true",
                       help="empty this user's entries in the remote cache (OPB_REMOTE_CACHE) instead of the local cache")

    new = sub.add_parser("new", help="write a working skeleton of your own op (builder, kernels, binding, test)")
    new.add_argument("name", metavar="NAME", help="the op's name, lower_snake_case")
    new.add_argument("--cuda", action="store_true", help="add a CUDA kernel beside the CPU one")
    new.add_argument("--abi", choices=("stable", "classic"), default="stable",
                     help="binding on the LibTorch stable ABI (default: ~1 s to compile, loads in torch 2.10 and "
                          "later) or classic torch/library.h + ATen (~6 s, tied to one torch version)")
    new.add_argument("--dir", default=".", type=Path, help="folder to write NAME/ into (default: here)")

    chk = sub.add_parser("check", help="every implementation of an op against a float64 reference, with a status each")
    chk.add_argument("op", metavar="OP", help="the op (a built-in one)")
    chk.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    chk.add_argument("--json", action="store_true", help="print the rows as JSON")
    chk.add_argument("--timeout", type=float, default=None, metavar="S",
                     help="seconds one call of an implementation may take before it is stopped (TIMEOUT; default 300)")
    chk.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                     help="import MODULE first: where a user op's definition and implementations are registered")

    tune = sub.add_parser("tune", help="time the implementations that pass; dispatch then picks the fastest")
    tune.add_argument("op", metavar="OP", help="the op (a built-in one)")
    tune.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    tune.add_argument("--budget-ms", type=float, default=200.0, help="time budget per implementation and workload")
    tune.add_argument("--json", action="store_true", help="print the stored trace")
    tune.add_argument("--timeout", type=float, default=None, metavar="S",
                      help="seconds one call of an implementation may take in its check (default 300)")
    tune.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE first: where a user op's definition and implementations are registered")

    commands = sub.add_parser(
        "compile-commands", help="write compile_commands.json for clangd and IDEs (the exact compiler commands)")
    commands.add_argument("ops", nargs="*", metavar="OP",
                          help="built-in ops, or your own builder as module:Class (default: every built-in op)")
    commands.add_argument("--output", "-o", type=Path, default=Path("compile_commands.json"),
                          help="file to write (default: ./compile_commands.json)")
    commands.add_argument("--cuda-arch", default=None, metavar="LIST",
                          help="list the CUDA files too, compiled for LIST (e.g. '9.0'), also with a torch without CUDA")

    ccheck = sub.add_parser(
        "compile-check", help="compile every source of ops into objects, CUDA included, without a GPU (CI)")
    ccheck.add_argument("ops", nargs="*", metavar="OP",
                        help="built-in ops, or your own builder as module:Class (default: every built-in op)")
    ccheck.add_argument("--cuda-arch", default=None, metavar="LIST",
                        help="CUDA archs to compile for, e.g. '9.0' or '8.0;9.0' (default: TORCH_CUDA_ARCH_LIST); "
                             "the CUDA part compiles with nvcc also where torch has no CUDA")

    sub.add_parser("bench", help="benchmark the ops (arguments go to `opbuilder bench --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # every argument, --help included, belongs to the bench tool
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    handlers = {"report": _report, "build": _build, "clean": _clean, "new": _new,
                "compile-commands": _compile_commands, "compile-check": _compile_check, "check": _check,
                "tune": _tune}
    from opbuilder.errors import OpBuilderError, UnknownOpError

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.command in ("build", "check", "tune", "compile-check"):
            from opbuilder import env

            env.validate()  # a variable to fix: said first, before a build or a verdict
        return handlers[args.command](args)
    except KeyboardInterrupt:
        _err(f"opbuilder {args.command}: interrupted; running compilers were stopped and nothing half-built was published")
        return 130
    except (OpBuilderError, UnknownOpError, ImportError, ValueError) as exc:  # an unusable cache, a bad TORCH_CUDA_ARCH_LIST, ...
        _err(f"opbuilder {args.command}: {exc}")
        return 1


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM ends a build as Ctrl-C does: compilers stopped, nothing published


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- report ------------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    import json

    from opbuilder.tools import dispatch_report, report

    data = report.collect()
    data["dispatch"] = dispatch_report.collect()
    print(json.dumps(data, indent=1) if args.json else report.render(data) + "\n" + dispatch_report.render(data["dispatch"]))
    return 0


# ---- check, tune -------------------------------------------------------------------------------


def _import(modules: list[str]) -> None:
    import importlib

    sys.path.insert(0, str(Path.cwd()))  # a module of the project the command runs in
    for name in modules:
        importlib.import_module(name)


def _writable_traces(op: str) -> None:
    """Refuses a check or tune whose rows could not be stored (a read-only or full cache: CacheError) before it
    runs every implementation of ``op``; an unknown op is named first (UnknownOpError), with nothing written."""
    from opbuilder.dispatch import definitions, trace

    definitions.get(op)
    trace.check_writable(op)


def _check(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from opbuilder.dispatch import check
    from opbuilder.tools import dispatch_report

    _import(args.imports)
    _writable_traces(args.op)
    rows = check.check(args.op, args.device, timeout_s=check.CALL_TIMEOUT_S if args.timeout is None else args.timeout)
    where = check.save(args.op, rows, "check")
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(dispatch_report.render_rows(rows) + f"\nstored in {where}")
    return 0 if all(r.status == "PASSED" for r in rows) else 1


def _tune(args: argparse.Namespace) -> int:
    from opbuilder.dispatch import check
    from opbuilder.tools import dispatch_report

    _import(args.imports)
    _writable_traces(args.op)
    rows = check.tune(args.op, args.device, args.budget_ms, timeout_s=check.CALL_TIMEOUT_S if args.timeout is None else args.timeout)
    where = check.save(args.op, rows, "tune")
    if args.json:
        print(where.read_text())
    else:
        d = dispatch_report.op_dispatch(args.op)
        print(dispatch_report.render_rows(rows))
        print("dispatch picks: " + ("; ".join(f"{w}: {n}" for w, n in d["picks"].items()) or "the default"))
        print(f"stored in {where}")
    return 0


# ---- build -------------------------------------------------------------------------------------


def _build(args: argparse.Namespace) -> int:
    from opbuilder.jit import registry

    if not args.ops and not args.all:
        _err("opbuilder build: name the ops to build, or pass --all; known ops: " + ", ".join(registry.names()))
        return USAGE_ERROR
    if args.jobs is not None and args.jobs < 1:
        _err(f"opbuilder build: --jobs must be >= 1, got {args.jobs}")
        return USAGE_ERROR
    names = list(dict.fromkeys(args.ops)) or registry.names()
    unknown = [name for name in names if name not in registry.BUILDERS]
    if unknown:
        _err(f"opbuilder build: no built-in op named {', '.join(unknown)}; known ops: {', '.join(registry.names())}")
        return USAGE_ERROR

    # An op named on the command line that cannot be built here fails the command; under --all it
    # is skipped with its reason.
    todo, failed = [], []
    for name in names:
        try:
            builder = registry.get_builder(name)
        except Exception as exc:  # a broken builder is reported; the others still build
            builder, reasons = None, [f"its builder failed to import: {type(exc).__name__}: {exc}"]
        else:
            reasons = builder.incompatibility_reasons()
        if builder is not None and not reasons:
            todo.append(builder)
        elif args.ops:
            _err(f"{name}: cannot be built here: " + "; ".join(reasons))
            failed.append(name)
        else:
            print(f"{name}: skipped: " + "; ".join(reasons), flush=True)
    from opbuilder import env

    if args.all and todo and env.cxx_autograd():
        # The built-in ops' C++ gradient path (opbuilder.torchop.cxx_autograd), so that training never waits for it.
        from opbuilder.builders.autograd import AutogradGlueBuilder

        glue = AutogradGlueBuilder()
        if not glue.incompatibility_reasons():
            todo.append(glue)
    if todo:
        # All at once by default: their compilers share the cores through the compile slots.
        failed += _build_all(todo, args.jobs or len(todo))
        _fill_remote([b for b in todo if b.name not in failed])
    if failed:
        _err(f"opbuilder build: failed: {', '.join(failed)}")
        return 1
    return 0


def _build_all(builders: list, jobs: int) -> list[str]:
    """Build into the cache, ``jobs`` ops at a time, one line per op as it ends; returns the ops
    that failed, after printing their compiler errors."""
    from opbuilder.jit.build import say
    from opbuilder.jit.warm import BUILT, prepare_each

    failed = []
    for name, outcome in prepare_each(builders, jobs):
        if isinstance(outcome, BaseException):
            say(f"{name}: FAILED\n{outcome}")
            failed.append(name)
        elif outcome != BUILT:  # a build already said what it did
            say(f"{name}: {outcome}")
    return failed


def _fill_remote(builders: list) -> None:
    """Share each good local build the remote tier (OPB_REMOTE_CACHE) lacks; one line per op."""
    from opbuilder.jit import cache, remote
    from opbuilder.jit.build import say

    tier = remote.tier(say)
    if tier is None:
        return
    for builder in builders:
        slot = cache.Slot(builder.name, builder.key)
        if cache.check_build(slot.path)[0] is not None:
            say(f"{builder.name}: {tier.push(slot, say, replace=False)}")


# ---- compile-commands --------------------------------------------------------------------------


def _builders(names: list[str]) -> list:
    """Built-in ops by name, or the user's own builders as module:Class (importable from here)."""
    import importlib

    from opbuilder.jit import registry
    from opbuilder.jit.builder import OpBuilder

    builders = []
    for name in names or registry.names():
        if ":" in name:
            module, _, cls = name.partition(":")
            found = getattr(importlib.import_module(module), cls, None)
            if not (isinstance(found, type) and issubclass(found, OpBuilder)):
                raise ValueError(f"{name}: expected module:Class naming an OpBuilder subclass, got "
                                 f"{'nothing' if found is None else repr(found)} as {cls!r} in {module}")
            builders.append(found())
        else:
            builders.append(registry.get_builder(name))
    return builders


def _compile_commands(args: argparse.Namespace) -> int:
    import json

    from opbuilder.jit import compile

    entries = []
    for builder in _builders(args.ops):
        archs = args.cuda_arch.replace(",", ";").split(";") if args.cuda_arch else None
        if archs:
            builder = builder.for_cuda_check(archs)
        skipped = builder.cuda_skip_reason()
        if skipped and any(p.suffix == ".cu" for p in builder.all_sources()):
            _err(f"{builder.name}: CUDA files not listed: {skipped} (--cuda-arch LIST lists them, compiled for LIST)")
        entries += compile.compile_commands(builder.build_spec())
    try:
        args.output.write_text(json.dumps(entries, indent=1) + "\n")
    except OSError as exc:
        _err(f"opbuilder compile-commands: --output {args.output}: cannot write it ({exc.strerror or exc})")
        return 1
    print(f"wrote {args.output} ({len(entries)} files)")
    return 0


def _compile_check(args: argparse.Namespace) -> int:
    from opbuilder.jit.compile_check import compile_check, describe

    archs = args.cuda_arch.replace(",", ";").split(";") if args.cuda_arch else None
    failed = 0
    for builder in _builders(args.ops):
        check = compile_check(builder, archs)
        for line in describe(check):
            print(line, flush=True)
        failed += not check.ok
    return 1 if failed else 0


# ---- clean -------------------------------------------------------------------------------------


def _clean(args: argparse.Namespace) -> int:
    from opbuilder.jit.builder import is_op_name

    bad = [op for op in args.ops if not is_op_name(op)]
    if bad:  # a path would name a folder outside the cache (root / "/abs" is "/abs"), and its builds would go
        _err(f"opbuilder clean: OP must be an op's name (letters, digits and '_', as in the cache's folders), "
             f"got {', '.join(map(repr, bad))}")
        return USAGE_ERROR
    if args.remote:
        return _clean_remote(list(dict.fromkeys(args.ops)) or None)
    from opbuilder import paths
    from opbuilder.jit import cache, registry, toolchain
    from opbuilder.jit.locks import FileLock, Timeout
    from opbuilder.tools import report

    root = paths.root()
    ops = list(dict.fromkeys(args.ops)) or report.cached_ops(root)
    here = toolchain.torch_environment() if args.stale else {}
    removed = kept = busy = 0
    freed = 0
    for op in ops:
        op_dir = paths.op_dir(op)
        if not op_dir.is_dir():
            print(f"{op}: nothing in the cache")
            continue
        builder = None
        if args.stale and op in registry.BUILDERS:
            try:
                builder = registry.get_builder(op)
            except Exception as exc:
                _err(f"{op}: its builder failed to import ({type(exc).__name__}: {exc}); judging by environment only")
        keys = {p.name for p in report.cached_keys(op_dir)}
        if not args.stale:  # failures and leftover temporary folders of keys with no build go too
            keys |= {p.name.split(".")[0] for p in op_dir.glob("*.failed.json")}
            keys |= {p.name[len(cache.TMP_PREFIX):].split("-")[0] for p in op_dir.glob(f"{cache.TMP_PREFIX}*-*") if p.is_dir()}
        for key in sorted(k for k in keys if _KEY.fullmatch(k)):  # anything else in the folder is not ours
            slot = cache.Slot(op, key)
            why = None
            if args.stale:
                why = report.stale_reason(cache.read_manifest(slot.path), builder, here)
                if why is None:
                    kept += 1
                    continue
            if slot.lock_path.is_symlink():  # never open a lock through a link (cache.refuse_symlink)
                _err(f"{op}/{key}: skipped, its lock {slot.lock_path} is a symbolic link")
                busy += 1
                continue
            lock = FileLock(str(slot.lock_path))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                print(f"{op}/{key}: skipped, another process is building it")
                busy += 1
                continue
            try:
                size = report.tree_size(slot.path) if slot.path.exists() else 0
                cache.retire(slot)
                cache.remove_stray_tmp_dirs(slot)
                for path in (slot.failure_path, paths.failure_log(op, key)):
                    if path.exists():
                        size += path.stat().st_size
                        path.unlink()
            finally:
                lock.release()
            removed += 1
            freed += size
            print(f"{op}/{key}: removed ({report.human(size)})" + (f": {why}" if why else ""))
        if not args.stale:
            freed += _clean_work(op)
    summary = f"removed {removed} build(s), {report.human(freed)}"
    if args.stale:
        summary += f"; kept {kept} current"
    if busy:
        summary += f"; skipped {busy} being built"
    print(summary)
    return 0


def _clean_remote(ops: list[str] | None) -> int:
    from opbuilder import env
    from opbuilder.jit import remote
    from opbuilder.jit.build import say

    tier = remote.tier(say)
    if tier is None:
        if env.remote_cache_url() is None:
            _err("opbuilder clean --remote: no remote cache: OPB_REMOTE_CACHE is not set")
        return 1
    try:
        removed = tier.clean(ops)
    except remote.RemoteUnavailable as exc:
        _err(f"opbuilder clean --remote: {tier.store.where}: {exc}")
        return 1
    what = ", ".join(ops) if ops else "every op"
    print(f"removed {removed} remote entr{'y' if removed == 1 else 'ies'} ({what}) from {tier.store.where} "
          f"under {tier.store.prefix}; builds in progress keep their leases")
    return 0


def _clean_work(op: str) -> int:
    """Remove the op's object folders (``opbuilder.jit.compile``) that no build is using; returns bytes freed."""
    import shutil

    from opbuilder import paths
    from opbuilder.jit.locks import FileLock, Timeout
    from opbuilder.tools import report

    freed = 0
    for work in sorted(paths.work_root().glob(f"{op}-*")):
        if not work.is_dir() or not _WORK.fullmatch(work.name[len(op) + 1:]):
            continue
        lock = FileLock(str(paths.work_lock(work)))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            freed += report.tree_size(work)
            shutil.rmtree(work, ignore_errors=True)
        finally:
            lock.release()
    return freed


# ---- new ---------------------------------------------------------------------------------------


def _new(args: argparse.Namespace) -> int:
    from opbuilder.tools import scaffold

    try:
        written = scaffold.create(args.name, args.dir, cuda=args.cuda, abi=args.abi)
    except (ValueError, FileExistsError) as exc:
        _err(str(exc))
        return USAGE_ERROR
    except OSError as exc:  # --dir not writable, a full disk
        _err(str(exc))
        return 1
    root = Path(args.dir) / args.name
    print(f"wrote {root}/ ({'CPU and CUDA' if args.cuda else 'CPU'}, {args.abi} ABI):")
    for path in written:
        print(f"  {path.relative_to(args.dir)}")
    cd = "" if Path(args.dir) == Path(".") else f"cd {args.dir} && "
    print(
        f"\nnext:\n  {cd}python -m pytest {args.name}/test_{args.name}.py -q    # the first test builds the op\n"
        f"  then replace the computation in {args.name}/csrc/ and keep {args.name}/ops.py's fake and backward in step"
    )
    return 0


# ---- bench -------------------------------------------------------------------------------------


def _bench(argv: list[str]) -> int:
    try:
        from opbuilder.tools import bench
    except ImportError as exc:
        _err(f"opbuilder bench is not available in this installation: {exc}")
        return USAGE_ERROR
    return int(bench.main(argv) or 0)
