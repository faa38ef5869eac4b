"""Build and edit-loop times of opbuilder beside torch.utils.cpp_extension.load, in one run.

    python benchmarks/build_speed.py [--repeat 3] [--cuda] [--json out.json]

Every figure is a fresh process's wall time after ``import torch`` (timed inside the process, so the
interpreter's and torch's start-up are excluded and shown apart), the median of ``--repeat`` runs:

- cold relu: an empty cache, then ``opbuilder.ops.relu(x)`` (build + load + first call); peer:
  ``cpp_extension.load`` of the same sources and flags into an empty build folder.
- edit loop: a two-file user op (a binding + a plain C++ kernel) built once, then its kernel file edited
  and the op loaded; peer: ``cpp_extension.load`` of the same files after the same edit (its build folder
  kept, so ninja recompiles the one file). Both binding styles: stable ABI and classic ``torch/library.h``.
- with --cuda (a GPU machine): cold relu CPU+CUDA, ``opbuilder build --all`` from an empty cache, and an
  edit of one ``.cu`` of softmax (and of the kernels' header all its ``.cu`` include) followed by a load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))

import twofile  # noqa: E402  (the tests' two-file op: one source of truth)

TIMED = "import time as _t; _t0 = _t.perf_counter()\nimport torch\n_t1 = _t.perf_counter()\n{body}\nprint('TIMES', _t1 - _t0, _t.perf_counter() - _t1)\n"


def run(body: str, env: dict[str, str]) -> tuple[float, float, str]:
    """(import torch s, the rest s, stderr) of ``body`` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", TIMED.format(body=body)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark step failed:\n{body}\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("TIMES"))
    _, imp, rest = line.split()
    return float(imp), float(rest), proc.stderr


RELU_OPB = "import opbuilder.ops as ops\nx = torch.randn(1000, device='{device}')\nops.relu(x)\n{sync}"
RELU_PEER = textwrap.dedent("""
    from torch.utils.cpp_extension import load
    from opbuilder.jit.registry import get_builder
    spec = get_builder('relu').build_spec()
    load(name='relu_peer', sources=spec.sources, extra_cflags=spec.cxx_args + ['-DOPB_NAMESPACE=opb_relu_peer'],
         extra_cuda_cflags=spec.nvcc_args + ['-DOPB_NAMESPACE=opb_relu_peer'], extra_ldflags=spec.ldflags,
         extra_include_paths=spec.include_paths, build_directory={build!r}, with_cuda=spec.with_cuda,
         is_python_module=False)
    x = torch.randn(1000, device='{device}')
    torch.ops.opb_relu_peer.relu(x)
    {sync}
""")


def cold_relu(repeat: int, device: str) -> dict:
    sync = "torch.cuda.synchronize()" if device == "cuda" else ""
    ours, peer, imports = [], [], []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as tmp:
            imp, rest, _ = run(RELU_OPB.format(device=device, sync=sync), {"OPB_CACHE_DIR": tmp})
            ours.append(rest)
            imports.append(imp)
        with tempfile.TemporaryDirectory() as tmp:
            _, rest, _ = run(RELU_PEER.format(build=tmp, device=device, sync=sync), {"OPB_CACHE_DIR": tmp + "/c"})
            peer.append(rest)
    return {"case": f"cold relu ({device})", "ours": ours, "peer": peer, "import_torch": imports}


def edit_loop(repeat: int, abi: str) -> dict:
    name = f"bench_edit_{abi}"
    ours, peer = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = twofile.write_op(Path(tmp) / "proj", name=name, abi=abi)
        cache_env = {"OPB_CACHE_DIR": str(Path(tmp) / "cache")}
        run(twofile.run_snippet(root, name), cache_env)  # the first build
        peer_dir = Path(tmp) / "peer"
        peer_dir.mkdir()
        peer_body = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(root)!r})
            from torch.utils.cpp_extension import load
            from two_file_ops import TwoFileBuilder
            spec = TwoFileBuilder().build_spec()
            load(name='peer_{name}', sources=spec.sources, extra_cflags=spec.cxx_args + ['-DOPB_NAMESPACE=peer_{name}'],
                 extra_ldflags=spec.ldflags, extra_include_paths=spec.include_paths, build_directory={str(peer_dir)!r},
                 is_python_module=False)
        """)
        run(peer_body, cache_env)  # the peer's first build
        for i in range(repeat):
            twofile.set_kernel(root, str(3 + i))
            _, rest, err = run(twofile.run_snippet(root, name), cache_env)
            assert "(1 of 2 files compiled)" in err, err
            ours.append(rest)
            _, rest, _ = run(peer_body, cache_env)
            peer.append(rest)
    return {"case": f"edit the kernel of a 2-file op ({abi} binding), then load", "ours": ours, "peer": peer}


def cuda_cases(repeat: int):
    yield cold_relu(repeat, "cuda")
    times = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "opbuilder", "build", "--all"], capture_output=True, text=True,
                                  env={**os.environ, "OPB_CACHE_DIR": tmp})
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            times.append(time.perf_counter() - started)
    yield {"case": "opbuilder build --all from an empty cache (whole command)", "ours": times, "peer": []}
    softmax = HERE.parent / "kernels" / "softmax"
    # One .cu of softmax (its float32 forward kernels), and the kernels' header every .cu includes.
    for edited in (softmax / "softmax_forward_f32.cu", softmax / "softmax_kernel.cuh"):
        yield edit_softmax(repeat, edited)


SOFTMAX_PEER = textwrap.dedent("""
    from torch.utils.cpp_extension import load
    from opbuilder.jit.registry import get_builder
    spec = get_builder('softmax').build_spec()
    load(name='softmax_peer', sources=spec.sources, extra_cflags=spec.cxx_args + ['-DOPB_NAMESPACE=opb_softmax_peer'],
         extra_cuda_cflags=spec.nvcc_args + ['-DOPB_NAMESPACE=opb_softmax_peer'], extra_ldflags=spec.ldflags,
         extra_include_paths=spec.include_paths, build_directory={build!r}, with_cuda=True, is_python_module=False)
    torch.ops.opb_softmax_peer.forward(torch.randn(8, 8, device='cuda'))
    torch.cuda.synchronize()
""")


def edit_softmax(repeat: int, edited: Path) -> dict:
    """Edit one file of softmax, then load + first call; peer: cpp_extension.load's own incremental build
    of the same sources after the same edit."""
    original = edited.read_text()
    ours, peer = [], []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"OPB_CACHE_DIR": tmp + "/cache"}
        body = "import opbuilder.ops as ops\nops.softmax(torch.randn(8, 8, device='cuda'))\ntorch.cuda.synchronize()"
        peer_body = SOFTMAX_PEER.format(build=tmp)
        run(body, env)
        run(peer_body, env)
        try:
            for i in range(repeat):
                edited.write_text(original + f"\n// edit {i} {time.time()}\n")
                ours.append(run(body, env)[1])
                peer.append(run(peer_body, env)[1])
        finally:
            edited.write_text(original)
    return {"case": f"edit {edited.name}, then load + first call", "ours": ours, "peer": peer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cuda", action="store_true", help="also the CUDA cases (a GPU machine)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = parser.parse_args()
    if shutil.which("ninja") is None:
        sys.exit("ninja is needed (pip install ninja)")
    print(f"{'case':<62} {'opbuilder s':>12} {'cpp_extension.load s':>21} {'ratio':>6}", flush=True)
    steps = [lambda: [cold_relu(args.repeat, "cpu")], lambda: [edit_loop(args.repeat, "stable")],
             lambda: [edit_loop(args.repeat, "classic")]] + ([lambda: cuda_cases(args.repeat)] if args.cuda else [])
    results: list[dict] = []
    for step in steps:  # each row as soon as it is measured
        for r in step():
            results.append(r)
            ours = statistics.median(r["ours"])
            peer = statistics.median(r["peer"]) if r["peer"] else None
            ratio = f"{peer / ours:.1f}x" if peer else "-"
            print(f"{r['case']:<62} {ours:>12.2f} {peer if peer is None else round(peer, 2)!s:>21} {ratio:>6}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    imports = [t for r in results for t in r.get("import_torch", [])]
    print(f"(medians of {args.repeat}; `import torch` itself, not counted above: {statistics.median(imports):.2f} s)")


if __name__ == "__main__":
    main()
