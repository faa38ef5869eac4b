"""``opbuilder check`` and ``opbuilder tune``: every implementation of an op on its definition's workloads
and edge shapes, against a float64 evaluation of the reference; then the passing ones timed with the
benchmark's timer. Statuses as FlashInfer-Bench's: PASSED, INCORRECT_NUMERICAL, INCORRECT_SHAPE,
INCORRECT_DTYPE, COMPILE_ERROR (it cannot be built or loaded here), RUNTIME_ERROR (a call raised); and
MUTATES_INPUT (it wrote into an input: each implementation gets its own copies of the inputs, compared
with the originals after the call, so one that writes into them neither passes nor fools the next).

Where the reference gives an infinity or NaN, only the same value passes: the tolerance there would be
infinite (or NaN), so it is not used.

Each implementation runs in a child process (forked, so that implementations registered in code at run
time, lambdas included, are there as they are), with a time limit per call: one that kills its process
(a segfault, an abort) is CRASH for the workload it was running, one that runs past the limit is stopped
and TIMEOUT, and a new child goes on with the next workload. The inputs and the float64 reference are made
once, here, before the children are forked. A forked child cannot start OpenMP's threads again (it would
hang), so implementations run on one CPU thread there; ``tune``'s timings are taken in this process. On a
GPU the inputs are made on the CPU and each child copies them to the GPU (a process that has used the GPU
cannot fork a child that does): where this process has used the GPU already, the implementations run in
it, with no time limit, and a warning says so.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from opbuilder import env
from opbuilder.dispatch import definitions, implementations, routes, trace
from opbuilder.dispatch.implementations import Implementation
from opbuilder.errors import EnvError

STATUSES = ("PASSED", "INCORRECT_NUMERICAL", "INCORRECT_SHAPE", "INCORRECT_DTYPE", "COMPILE_ERROR", "RUNTIME_ERROR",
            "MUTATES_INPUT", "TIMEOUT", "CRASH")

#: Seconds one call of an implementation may take in ``check`` (its first call: a torch.compile compiles).
CALL_TIMEOUT_S = 300.0
#: Seconds loading one implementation may take in ``check``'s child (a cold build of a CUDA op included).
LOAD_TIMEOUT_S = 1800.0


@dataclass
class Row:
    implementation: str
    workload: str
    shape: list[int]
    dtype: str
    device: str
    device_name: str
    bucket: list
    status: str
    max_abs: float | None = None
    max_rel: float | None = None
    message: str = ""
    us: float | None = None


def _tensors(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """|got - want| (0 where both are NaN, or equal infinities), where they are the same value (NaN
    included), the max error, and the max relative error."""
    g, w = got.double(), want.double()
    same = (g == w) | (g.isnan() & w.isnan())
    err = torch.where(same, torch.zeros_like(g), (g - w).abs().nan_to_num(nan=float("inf")))
    if err.numel() == 0:
        return err, same, 0.0, 0.0
    rel = torch.where(err == 0, err, err / w.abs().clamp_min(1e-30))
    return err, same, err.max().item(), rel.max().item()


def compare(definition: definitions.Definition, workload: definitions.Workload, out: Any, want64: Any,
            want_dtypes: tuple) -> tuple[str, float | None, float | None, str]:
    """(status, max abs error, max rel error, message) of ``out`` against the float64 reference's output."""
    got, want = _tensors(out), _tensors(want64)
    if len(got) != len(want) or not all(isinstance(t, torch.Tensor) for t in got):
        return "INCORRECT_SHAPE", None, None, f"{len(got)} outputs, expected {len(want)} tensors"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return "INCORRECT_SHAPE", None, None, f"output {i}: shape {list(g.shape)}, expected {list(w.shape)}"
    for i, (g, d) in enumerate(zip(got, want_dtypes)):
        if g.dtype != d:
            return "INCORRECT_DTYPE", None, None, f"output {i}: {g.dtype}, expected {d}"
    rtol, atol = definition.tolerance(workload.shape, workload.dtype)
    worst_abs = worst_rel = 0.0
    ok = True
    for g, w in zip(got, want):
        err, same, abs_max, rel_max = _errors(g.cpu(), w.cpu())
        worst_abs, worst_rel = max(worst_abs, abs_max), max(worst_rel, rel_max)
        w64 = w.cpu().double()
        # where the reference is inf or NaN its tolerance is too: only the same value passes there
        ok = ok and bool((same | (w64.isfinite() & (err <= atol + rtol * w64.abs()))).all())
    if not ok:
        return "INCORRECT_NUMERICAL", worst_abs, worst_rel, f"beyond rtol={rtol:.1e}, atol={atol:.1e}"
    return "PASSED", worst_abs, worst_rel, ""


def _call(impl: Implementation, inputs: list) -> Any:
    with torch.no_grad():
        return impl.fn(*inputs)


def _copy(t: Any, device: torch.device | None = None) -> Any:
    """A tensor's copy (on ``device``, or its own) with the same sizes and strides (contiguous where they
    overlap); other values as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device or t.device)
    try:
        return out.copy_(t)
    except RuntimeError:  # an expanded input: its elements share memory, a copy cannot
        return t.clone().to(out.device)


def _written(before: list, after: list, names: list[str]) -> str | None:
    """Which input an implementation wrote into (``after`` its copies of ``before``), or None."""
    for i, (b, a) in enumerate(zip(before, after)):
        if not isinstance(b, torch.Tensor):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            changed = True
        else:
            a = a.to(b.device)
            same = a == b
            if b.is_floating_point() or b.is_complex():
                same |= a.isnan() & b.isnan()
            changed = not bool(same.all())
        if changed:
            name = f" ({names[i]})" if i < len(names) else ""
            return f"it wrote into input {i}{name}; an implementation must leave its inputs as they were"
    return None


def _run(definition: definitions.Definition, impl: Implementation, w: definitions.Workload, inputs: list,
         want64: Any, want_dtypes: tuple, row: Row, device: torch.device | None = None) -> None:
    """Call ``impl`` on its own copies of ``inputs`` (on ``device``); set the row's status, errors and message."""
    mine = [_copy(t, device) for t in inputs]
    try:
        out = _call(impl, mine)
    except Exception as exc:
        row.status, row.message = "RUNTIME_ERROR", f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        return
    row.status, row.max_abs, row.max_rel, row.message = compare(definition, w, out, want64, want_dtypes)
    written = _written(inputs, mine, list(definition.inputs))
    if written is not None:
        row.status, row.message = "MUTATES_INPUT", written


def _device(op: str, device: str | torch.device) -> torch.device:
    """``device`` as a torch.device of type cpu or cuda; a ValueError naming --device otherwise."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: --device must be cpu or cuda, got {str(device)!r}")
    return parsed


def _positive(op: str, flag: str, what: str, value: object) -> None:
    """A ValueError naming ``flag`` unless ``value`` is a finite number > 0."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{op}: {flag} ({what}) must be a finite number > 0, got {value!r}")


def check(op: str, device: str | torch.device = "cpu", names: list[str] | None = None,
          timeout_s: float = CALL_TIMEOUT_S) -> list[Row]:
    """One row per implementation and workload (the definition's for this device, then the edge shapes).

    Each implementation runs in a child process, each call within ``timeout_s`` seconds (the module's
    docstring says how, and when it cannot)."""
    env.validate()  # a variable to fix is an error before any verdict (a child's load would record it as one)
    device = _device(op, device)
    _positive(op, "--timeout", "the seconds a call may take", timeout_s)
    definition = definitions.get(op)
    impls = [i for i in implementations.of(op) if names is None or i.name in names]
    isolated = device.type == "cpu" or _gpu_in_a_child(op)
    made_on = torch.device("cpu") if isolated else device
    cases = []
    for w in definition.workloads_for(device):
        inputs = definition.inputs_for(w, made_on)
        as64 = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
        with torch.no_grad():
            want64 = definition.reference(*[_copy(t) for t in as64])
            want_dtypes = tuple(t.dtype for t in _tensors(definition.reference(*[_copy(t) for t in inputs])))
        cases.append((w, inputs, want64, want_dtypes))
    results = []
    for impl in impls:
        if isolated:
            results.append((impl, _in_children(definition, impl, cases, device, timeout_s)))
        else:
            results.append((impl, [_in_this_process(definition, impl, case, device) for case in cases]))
    where = trace.device_name(device.type)  # on a GPU, only now: this process may use it once no child is left
    rows = []
    for impl, outcomes in results:
        for (w, inputs, _, _), (status, max_abs, max_rel, message) in zip(cases, outcomes):
            rows.append(Row(impl.name, w.name, list(w.shape), str(w.dtype).removeprefix("torch."), device.type, where,
                            list(trace.bucket(trace.first_tensor(tuple(inputs)))), status, max_abs, max_rel, message))
    return rows


Outcome = tuple[str, "float | None", "float | None", str]  # status, max abs error, max rel error, message


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def _outcome(definition: definitions.Definition, impl: Implementation, case: tuple,
             device: torch.device | None) -> Outcome:
    w, inputs, want64, want_dtypes = case
    row = Row(impl.name, w.name, [], "", "", "", [], "RUNTIME_ERROR")
    _run(definition, impl, w, inputs, want64, want_dtypes, row, device)
    return row.status, row.max_abs, row.max_rel, row.message


def _in_this_process(definition: definitions.Definition, impl: Implementation, case: tuple,
                     device: torch.device) -> Outcome:
    try:
        impl.load()
    except EnvError:  # a variable to fix: no verdict on the implementation
        raise
    except Exception as exc:  # cannot be built or loaded here
        return "COMPILE_ERROR", None, None, _reason(exc)
    return _outcome(definition, impl, case, device)


def _gpu_in_a_child(op: str) -> bool:
    """Whether a forked child can use the GPU (asked in a child: asking here would keep it from doing so).
    Raises ValueError when this torch sees no GPU; False, with a warning, when only this process can use it."""
    problem = "this process has used the GPU already" if torch.cuda.is_initialized() else _in_a_child(_touch_gpu)
    if problem is None:
        return True
    if not torch.cuda.is_available():
        raise ValueError(f"{op}: --device cuda, but this torch sees no GPU ({torch.__version__})")
    warnings.warn(f"opbuilder check {op}: the implementations run in this process, with no time limit: a forked "
                  f"child cannot use the GPU ({problem}). Run `opbuilder check` in a process of its own to "
                  f"isolate them.", RuntimeWarning, stacklevel=3)
    return False


def _touch_gpu() -> None:
    torch.zeros(1, device="cuda").item()


def _in_a_child(fn: Any, limit_s: float = 120.0) -> str | None:
    """Run ``fn()`` in a forked child: None when it returned, else what went wrong."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = _start(ctx, _probe, (send, fn))
    try:
        if not recv.poll(limit_s):
            return f"no answer within {limit_s:g} s"
        return recv.recv()
    except EOFError:
        proc.join(5)
        return _death(proc.exitcode)
    finally:
        _stop(proc)
        recv.close()


def _probe(send: Any, fn: Any) -> None:
    try:
        fn()
        send.send(None)
    except Exception as exc:
        send.send(_reason(exc))


def _start(ctx: Any, target: Any, args: tuple) -> Any:
    with warnings.catch_warnings():  # Python 3.12 warns about fork in a process with threads: this child copes
        warnings.simplefilter("ignore", DeprecationWarning)
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
    args[0].close()  # the child's end of the pipe: closed here, so that its death reads as the end of the pipe
    return proc


def _stop(proc: Any) -> None:
    """End the child and everything it started: its session's process group, which outlives the child while
    a process it forked is left (the group's id is not reused meanwhile)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child made itself a session (and group) of its own
    except OSError:  # not yet (then the child alone), or nothing left of it
        if proc.is_alive():
            proc.kill()
    proc.join()


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"its process was killed by {signal.Signals(-code).name}"
    return f"its process ended with status {code}"


def _in_children(definition: definitions.Definition, impl: Implementation, cases: list, device: torch.device,
                 timeout_s: float) -> list[Outcome]:
    """``impl`` on every case in a forked child, one call at a time within ``timeout_s``; after a crash or a
    time-out, a new child for the cases left."""
    ctx = multiprocessing.get_context("fork")
    outcomes: dict[int, Outcome] = {}
    start = 0
    while start < len(cases):
        recv, send = ctx.Pipe(duplex=False)
        proc = _start(ctx, _child, (send, definition, impl, cases, start, device))
        current, limit = None, LOAD_TIMEOUT_S  # the case being run
        deadline = time.monotonic() + limit
        failure, loaded = None, False
        try:
            while True:
                # a message, or the child's end; every half second, whether it ended (a process it forked
                # may hold the pipe and the sentinel open after it)
                left = deadline - time.monotonic()
                if left <= 0:
                    failure = "TIMEOUT", f"no result within {limit:g} s: stopped"
                    break
                ready = multiprocessing.connection.wait([recv, proc.sentinel], min(left, 0.5))
                if recv not in ready and not recv.poll():
                    if proc.is_alive():
                        continue
                    failure = "CRASH", _death(proc.exitcode)
                    break
                try:
                    message = recv.recv()
                except EOFError:
                    proc.join(5)
                    failure = "CRASH", _death(proc.exitcode)
                    break
                except Exception as exc:  # the implementation wrote into the pipe: its process is not trusted
                    failure = "CRASH", f"its process sent something unreadable ({_reason(exc)})"
                    break
                if not _valid(message, start, len(cases)):
                    failure = "CRASH", f"its process sent something unreadable ({str(message)[:100]})"
                    break
                if message[0] == "load failed":
                    for i in range(start, len(cases)):
                        outcomes[i] = "COMPILE_ERROR", None, None, message[1]
                    break
                if message[0] == "done":
                    break
                if message[0] == "start":
                    current, loaded = message[1], True
                else:  # "result"
                    outcomes[message[1]] = message[2]
                    current = None
                limit = timeout_s
                deadline = time.monotonic() + limit
        finally:
            _stop(proc)
            recv.close()
        if failure is not None and not loaded:  # while loading: nothing of it can run
            for i in range(start, len(cases)):
                outcomes.setdefault(i, (failure[0], None, None, f"while loading: {failure[1]}"))
        elif failure is not None:  # in a call (or between two: then the next one is marked, so that this ends)
            current = current if current is not None else min(set(range(start, len(cases))) - set(outcomes))
            outcomes[current] = failure[0], None, None, failure[1]
        start = max([start - 1, *outcomes]) + 1
    return [outcomes[i] for i in range(len(cases))]


def _valid(message: Any, start: int, n: int) -> bool:
    """Whether a child's message is one ``_child`` sends (an implementation could write into the pipe)."""
    if not (isinstance(message, tuple) and message and isinstance(message[0], str)):
        return False
    kind, rest = message[0], message[1:]
    if kind in ("start", "result") and not (rest and type(rest[0]) is int and start <= rest[0] < n):
        return False
    if kind == "result":
        return len(rest) == 2 and isinstance(rest[1], tuple) and len(rest[1]) == 4 and rest[1][0] in STATUSES
    return (kind, len(rest)) in (("start", 1), ("done", 0)) or (kind == "load failed" and len(rest) == 1)


def _child(send: Any, definition: definitions.Definition, impl: Implementation, cases: list, start: int,
           device: torch.device) -> None:
    os.setsid()  # a session of its own: stopping it stops what it started (a compiler, a torch.compile worker)
    torch.set_num_threads(1)  # OpenMP's threads cannot start again in a forked child: more than one would hang
    try:
        impl.load()
    except Exception as exc:  # cannot be built or loaded here
        send.send(("load failed", _reason(exc)))
        return
    for i in range(start, len(cases)):
        send.send(("start", i))
        send.send(("result", i, _outcome(definition, impl, cases[i], device)))
    send.send(("done",))


def keys(op: str) -> dict[str, str]:
    return {i.name: i.key for i in implementations.of(op)}


def save(op: str, rows: list[Row], kind: str) -> Any:
    return trace.write(op, keys(op), [asdict(r) for r in rows], kind)


def tune(op: str, device: str | torch.device = "cpu", budget_ms: float = 200.0,
         timeout_s: float = CALL_TIMEOUT_S) -> list[Row]:
    """``check``, then the median time of each implementation that passed, on each workload."""
    from opbuilder.dispatch.timing import CpuTimer, CudaTimer

    device = _device(op, device)
    _positive(op, "--budget-ms", "the time budget per implementation and workload", budget_ms)
    rows = check(op, device, timeout_s=timeout_s)
    timer = CpuTimer(budget_ms=budget_ms, warmup_ms=budget_ms / 5) if device.type == "cpu" else \
        CudaTimer(device, budget_ms=budget_ms, warmup_ms=budget_ms / 5)
    definition = definitions.get(op)
    impls = {i.name: i for i in implementations.of(op)}
    inputs_of = {w.name + str(w.dtype): (w, definition.inputs_for(w, device)) for w in definition.workloads_for(device)}
    for row in rows:
        if row.status != "PASSED":
            continue
        w, inputs = inputs_of[row.workload + "torch." + row.dtype]
        impl = impls[row.implementation]
        # A built-in op's own path is timed as dispatch runs it: its public function, without the router.
        fn = implementations.public_function(op) if impl.in_body else impl.fn
        with torch.no_grad(), routes.bypass(op):
            row.us = timer.measure(lambda i: fn(*inputs)).summary()["us"]
    return rows


def last_statuses(op: str) -> dict[str, str]:
    """Implementation -> its worst status in the newer of the last check and tune of this op (any device);
    empty when there is none for these implementations."""
    k = trace.key(keys(op))
    found = [(trace.path(op, k, kind).stat().st_mtime, kind) for kind in ("tune", "check")
             if trace.path(op, k, kind).is_file()]
    if not found:
        return {}
    data = trace.read(op, k, max(found)[1]) or {}
    out: dict[str, str] = {}
    for r in data.get("rows", []):
        worst = out.get(r["implementation"], "PASSED")
        # a status this version does not know (a newer opbuilder's) counts as the worst
        out[r["implementation"]] = max(worst, r["status"], key=lambda s: STATUSES.index(s) if s in STATUSES else len(STATUSES))
    return out
