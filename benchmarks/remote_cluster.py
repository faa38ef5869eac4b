"""The remote cache tier (issue 25) on a simulated cluster: N "nodes" (groups of processes, each node with a
local cache of its own) and one Redis, all on this machine.

1. Cold start: every rank of every node starts at once and prepares every built-in op that can be built
   here (``opbuilder.prepare()``), then calls each op once and checks it against its float64 reference.
   Counted from the ranks' output: builds of each op in the whole cluster (target: exactly 1) and downloads.
2. Downloading node vs warm node: a fresh process with an empty local cache calls each op once (a download
   from the tier, checked and published locally, then a load); then a fresh process on that now warm cache
   does the same (a local load). Per op, the median over --repeats of (download first call - warm first
   call). Target: <= 0.3 s per op.
3. Builder killed: on an empty prefix, node A starts building --kill-op and node B waits for it; then A is
   killed with its compilers (kill -9 of its session), mid-build. Target: B has a working op within the
   lease time plus one build of the op after the kill; nobody hangs.

Usage: python benchmarks/remote_cluster.py [--nodes 4] [--ranks 2] [--repeats 3] [--lease 10] [--kill-op relu]
       [--json FILE]
Needs ``redis-server`` (``apt-get install -y redis-server``) and the redis client (``pip install
'opbuilder[remote]'``); it starts its own server on a free loopback port and stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_server import RedisServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Prepares every buildable built-in op at once, then calls each, checked against its float64 reference.
RANK = """
import json, sys, time
t0 = time.perf_counter()
import torch
from opbuilder import prepare
from opbuilder.dispatch import check, definitions, routes as dispatch, implementations
from opbuilder.jit.registry import get_builder, names
ops = [n for n in names() if get_builder(n).is_compatible()]
t1 = time.perf_counter()
prepare(ops)
t2 = time.perf_counter()
status = {}
for op in ops:
    d = definitions.get(op)
    w = d.workloads_for(torch.device("cpu"))[0]
    inputs = d.inputs_for(w, torch.device("cpu"))
    as64 = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    with torch.no_grad():
        want64 = d.reference(*as64)
        dtypes = tuple(t.dtype for t in check._tensors(d.reference(*inputs)))
        with dispatch.bypass(op):
            out = implementations.public_function(op)(*inputs)
    status[op] = check.compare(d, w, out, want64, dtypes)[0]
print(json.dumps({"ops": ops, "status": status, "import_s": t1 - t0, "prepare_s": t2 - t1,
                  "calls_s": time.perf_counter() - t2}))
"""

# The first call of each op in a fresh process (its load included), on the op's smallest workload, timed
# per op. The remote tier's client is started first and timed apart: a process pays that once, not per op.
FIRST_CALLS = """
import json, math, sys, time
import torch
from opbuilder.dispatch import definitions, routes as dispatch, implementations
from opbuilder.jit import build, remote
from opbuilder.jit.registry import get_builder, names
ops = [n for n in names() if get_builder(n).is_compatible()]
t = time.perf_counter()
remote.tier(build.say)
times = {"client_start": time.perf_counter() - t}
for op in ops:
    d = definitions.get(op)
    w = min(d.workloads_for(torch.device("cpu")), key=lambda w: math.prod(w.shape))
    inputs = d.inputs_for(w, torch.device("cpu"))
    fn = implementations.public_function(op)
    t = time.perf_counter()
    with torch.no_grad(), dispatch.bypass(op):
        fn(*inputs)
    times[op] = time.perf_counter() - t
print(json.dumps(times))
"""

LOAD_ONE = """
import json, time
from opbuilder.jit.registry import get_builder
get_builder({op!r}).load()
print(json.dumps({{"done": time.time()}}))
"""


def _start(code: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, **env}, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 1800) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"a rank failed ({proc.returncode}):\n{err.strip()[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), err


def cold_start(nodes: int, ranks: int, base: dict[str, str], tmp: Path) -> dict:
    t0 = time.perf_counter()
    procs = [(n, r, _start(RANK, {**base, "OPB_CACHE_DIR": str(tmp / f"node{n}")}))
             for n in range(nodes) for r in range(ranks)]
    outs = [(n, r, *_finish(p)) for n, r, p in procs]
    wall = time.perf_counter() - t0
    err = "".join(e for *_, e in outs)
    ops = outs[0][2]["ops"]
    builds = {op: len(re.findall(rf"^opbuilder: building {op} ", err, re.MULTILINE)) for op in ops}
    fetches = {op: len(re.findall(rf"^opbuilder: fetched {op} from", err, re.MULTILINE)) for op in ops}
    seconds = {m.group(1): float(m.group(2)) for m in re.finditer(r"^opbuilder: built (\w+) in ([\d.]+) s", err, re.MULTILINE)}
    failed = [(n, r, op, s) for n, r, out, _ in outs for op, s in out["status"].items() if s != "PASSED"]
    return {"wall_s": wall, "ops": ops, "builds": builds, "fetches": fetches, "build_s": seconds,
            "ranks_checked": len(outs), "not_passed": failed,
            "prepare_s": [out["prepare_s"] for *_, out, _ in outs]}


def first_calls(repeats: int, base: dict[str, str], tmp: Path) -> dict:
    samples: dict[str, list[float]] = {}
    download_s: dict[str, list[float]] = {}
    warm_s: dict[str, list[float]] = {}
    client_s: list[float] = []
    for k in range(repeats):
        env = {**base, "OPB_CACHE_DIR": str(tmp / f"fresh{k}")}
        down, err = _finish(_start(FIRST_CALLS, env))
        assert "opbuilder: building" not in err, f"a downloading node compiled:\n{err}"
        warm, err = _finish(_start(FIRST_CALLS, env))
        assert err == "", f"a warm load printed:\n{err}"
        client_s.append(down.pop("client_start"))
        warm.pop("client_start")
        for op in down:
            download_s.setdefault(op, []).append(down[op])
            warm_s.setdefault(op, []).append(warm[op])
            samples.setdefault(op, []).append(down[op] - warm[op])
        print(f"  [{k + 1}/{repeats}] " + ", ".join(f"{op} +{samples[op][-1] * 1e3:.0f} ms" for op in down), flush=True)
    ops = {op: {"download_first_call_ms": statistics.median(download_s[op]) * 1e3,
                "warm_first_call_ms": statistics.median(warm_s[op]) * 1e3,
                "over_warm_ms": statistics.median(samples[op]) * 1e3} for op in samples}
    return {"client_start_ms": statistics.median(client_s) * 1e3, "ops": ops}


def killed_builder(op: str, lease: float, base: dict[str, str], tmp: Path, client) -> dict:  # noqa: ANN001
    prefix = f"{base['OPB_REMOTE_CACHE_PREFIX']}-kill"
    env = {**base, "OPB_REMOTE_CACHE_PREFIX": prefix, "OPB_REMOTE_LEASE_SECONDS": str(lease)}
    a = _start(LOAD_ONE.format(op=op), {**env, "OPB_CACHE_DIR": str(tmp / "kill-a")})
    deadline = time.monotonic() + 300
    while not list(client.scan_iter(match=f"{prefix}:lease:{op}:*")):
        if time.monotonic() > deadline or a.poll() is not None:
            raise RuntimeError(f"node A never took the lease of {op}: {a.communicate()[1][-2000:]}")
        time.sleep(0.05)
    b = _start(LOAD_ONE.format(op=op), {**env, "OPB_CACHE_DIR": str(tmp / "kill-b")})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(b.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    while not any("opbuilder: waiting for the build" in ln for ln in list(lines)):
        if time.monotonic() > deadline or b.poll() is not None:
            raise RuntimeError(f"node B never waited for A's build: {''.join(lines)[-2000:]}")
        time.sleep(0.05)
    killed_at = time.time()  # A is building, B waits: kill -9 A's session, its compilers included
    os.killpg(a.pid, signal.SIGKILL)
    a.wait()
    stdout = b.stdout.read() if b.stdout else ""
    if b.wait(1800) != 0:
        raise RuntimeError(f"node B failed:\n{''.join(lines)[-3000:]}")
    reader.join(10)
    out, err = json.loads(stdout.strip().splitlines()[-1]), "".join(lines)
    built = re.search(rf"^opbuilder: built {op} in ([\d.]+) s", err, re.MULTILINE)
    took_over = "ended without a result (its lease expired)" in err
    return {"op": op, "lease_s": lease, "killed_to_working_s": out["done"] - killed_at,
            "b_build_s": float(built.group(1)) if built else None, "b_took_over": took_over,
            "b_waited": "opbuilder: waiting for the build" in err}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="ranks per node (processes sharing the node's cache)")
    p.add_argument("--repeats", type=int, default=3, help="fresh downloading/warm process pairs")
    p.add_argument("--lease", type=float, default=10.0, help="OPB_REMOTE_LEASE_SECONDS of the kill scenario")
    p.add_argument("--kill-op", default="relu")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import platform

    import torch

    result: dict = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "nodes": args.nodes, "ranks": args.ranks}
    with tempfile.TemporaryDirectory(prefix="opb-remote-cluster-") as name:
        tmp = Path(name)
        secret = tmp / "secret"
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
        with RedisServer(tmp / "redis") as server:
            result["redis"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
            base = {"OPB_REMOTE_CACHE": server.url, "OPB_REMOTE_CACHE_SECRET_FILE": str(secret),
                    "OPB_REMOTE_CACHE_PREFIX": f"bench:{uuid.uuid4().hex[:8]}"}
            print(f"1. cold start: {args.nodes} nodes x {args.ranks} ranks, every built-in op at once", flush=True)
            cold = result["cold"] = cold_start(args.nodes, args.ranks, base, tmp)
            once = all(n == 1 for n in cold["builds"].values())
            print(f"   {cold['wall_s']:.1f} s in all; builds per op in the cluster: {cold['builds']} "
                  f"({'each exactly once' if once else 'NOT once each'}); downloads per op: {cold['fetches']}")
            print(f"   build times: " + ", ".join(f"{op} {s:.1f} s" for op, s in cold["build_s"].items()))
            print(f"   {cold['ranks_checked']} ranks called every op: "
                  + ("all PASSED against the float64 reference" if not cold["not_passed"] else f"FAILED {cold['not_passed']}"),
                  flush=True)

            print(f"2. first call per op, downloading node vs warm local cache ({args.repeats} pairs of fresh processes)",
                  flush=True)
            calls = result["first_call"] = first_calls(args.repeats, base, tmp)
            print(f"   once per downloading process: the tier's client starts (import redis) in "
                  f"{calls['client_start_ms']:.0f} ms")
            for op, c in calls["ops"].items():
                print(f"   {op:<22} download {c['download_first_call_ms']:7.0f} ms   warm {c['warm_first_call_ms']:7.0f} ms"
                      f"   over warm {c['over_warm_ms']:6.0f} ms (target <= 300)")

            print(f"3. the building node killed mid-build of {args.kill_op}, another node waiting (lease {args.lease:.0f} s)",
                  flush=True)
            kill = result["kill"] = killed_builder(args.kill_op, args.lease, base, tmp, server.client())
            bound = args.lease + (kill["b_build_s"] or 0)
            print(f"   node B waited: {kill['b_waited']}, took over: {kill['b_took_over']}; working op "
                  f"{kill['killed_to_working_s']:.1f} s after the kill (lease {args.lease:.0f} s + its build "
                  f"{kill['b_build_s']} s = {bound:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
