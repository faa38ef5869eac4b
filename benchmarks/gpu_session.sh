#!/usr/bin/env bash
# Everything the GPU machine does: install, cold builds, the whole test suite (the CUDA tests included),
# the benchmark that writes RESULTS.md, the load-time numbers, the build times, and the stable-ABI check.
#   OUT=$OUT benchmarks/gpu_session.sh [tests] [bench] [buildspeed] [abi DIR]
#   (on the device tool; logs and results land in $OUT). abi DIR: a folder holding a library built
#   elsewhere (another torch) and its manifest.json, loaded and checked here against torch.relu.
# Both by default. On the H100 machine the suite takes about 7.5 minutes and the benchmark about 3, so
# within the device tool's 10 minutes a call, give each its own call.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/opb-gpu}"
mkdir -p "$out"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" OPB_CACHE_DIR="${OPB_CACHE_DIR:-/tmp/opb-cache}" PYTHONUNBUFFERED=1
py=python3

step() { echo "=== $* ($(date +%T))"; }

step install
$py -m pip install --no-deps --no-build-isolation -e . -q >/tmp/opb-install.log 2>&1 || { tail -20 /tmp/opb-install.log; exit 1; }
$py -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
# Liger-Kernel, the benchmark's peer: the machine has no network, so its wheel travels along (carry .whl).
for wheel in .whl/liger_kernel-*.whl; do
    [ -f "$wheel" ] && { $py -m pip install --no-deps -q "$wheel" && echo "installed $wheel"; }
done

step "a C++ check's error reaches Python (no crash), CPU and CUDA"
cat >/tmp/opb_errors.py <<'PY'
import torch
from opbuilder.ops.relu import relu_op
from opbuilder.ops.fused_matmul_add_relu import fused_matmul_add_relu_op
for dev in ("cpu", "cuda"):
    for name, call in [("relu dtype", lambda: relu_op()(torch.arange(4, device=dev))),
                       ("matmul K", lambda: fused_matmul_add_relu_op()(torch.zeros(4, 5, device=dev), torch.zeros(6, 3, device=dev), None))]:
        try:
            call(); print(dev, name, "no error", flush=True)
        except RuntimeError as e:
            print(dev, name, "ok:", str(e).splitlines()[0][:120], flush=True)
PY
$py -X faulthandler /tmp/opb_errors.py 2>&1 | tail -8

steps="${*:-tests bench}"
if [[ " $steps " == *" abi "* ]]; then
abi_dir=$(echo " $steps " | sed -E 's/.* abi ([^ ]+) .*/\1/')
step "a stable-ABI relu built with another torch ($abi_dir) loads and runs here"
$py - "$abi_dir" <<'PY'
import json, sys, pathlib, torch
d = pathlib.Path(sys.argv[1]); m = json.loads((d / "manifest.json").read_text())
torch.ops.load_library(str(d / m["artifact"]))
ns = getattr(torch.ops, m["namespace"])
x = torch.randn(1000, 37)
print("built with abi", m["inputs"]["abi"], "by torch", m.get("built_with_torch"), "; running under torch", torch.__version__)
print("relu equal to torch.relu:", torch.equal(ns.relu(x), torch.relu(x)), "; relu_mask ok:", torch.equal(ns.relu_mask(x)[0], torch.relu(x)))
PY
fi

step "cold build of every op"
/usr/bin/time -f "build --all: %e s" timeout 240 $py -m opbuilder build --all 2>&1 | tee "$out/build.log" | tail -12

if [[ " $steps " == *" buildspeed "* ]]; then
step "build and edit-loop times beside cpp_extension.load"
timeout 400 $py benchmarks/build_speed.py --cuda --repeat "${BUILD_REPEAT:-3}" --json "$out/build_speed.json" 2>&1 | tail -12
fi
if [[ " $steps " == *" train "* ]]; then
mkdir -p "$out/train"
step "the C++ gradient path: loaded after build --all"
$py -c "from opbuilder.torchop import cxx_autograd; print('C++ gradient path:', cxx_autograd.load(wait=True), cxx_autograd.state())"
step "training step, one GPU (benchmarks/train_step.py ${TRAIN_ARGS:-})"
timeout "${TRAIN_TIMEOUT:-300}" $py benchmarks/train_step.py ${TRAIN_ARGS:-} --json "$out/train/train_step.json" 2>&1 | tail -8
step "host time per call, CUDA and CPU tensors (benchmarks/host_overhead.py)"
timeout 200 $py benchmarks/host_overhead.py --device cuda --json "$out/train/host_cuda.json" 2>&1 | tail -17
timeout 200 $py benchmarks/host_overhead.py --device cpu --json "$out/train/host_cpu.json" 2>&1 | tail -17
step "profile of a step (benchmarks/profile_step.py)"
timeout 200 $py benchmarks/profile_step.py --out "$out/train" --rows 20 >/dev/null 2>&1; ls "$out/train"
fi

if [[ " $steps " == *" multigpu "* ]]; then
mkdir -p "$out/train"
n=$($py -c "import torch; print(torch.cuda.device_count())")
step "benchmarks/multi_gpu.py on $n GPUs (${MULTI_ARGS:-default size})"
OPB_CACHE_DIR="${MULTI_CACHE:-$OPB_CACHE_DIR}" timeout "${MULTI_TIMEOUT:-300}" torchrun --nproc_per_node "$n" benchmarks/multi_gpu.py \
    ${MULTI_ARGS:-} --json "$out/train/multi_gpu${MULTI_TAG:-}.json" 2>&1 | grep -v "^W1\|^  warnings" | tail -40
fi

if [[ " $steps " == *" tests "* ]]; then
step "tests (all but the slow ones), 8 workers"
timeout "${TEST_TIMEOUT:-540}" $py -m pytest tests -q -n 8 -m "not slow" -p no:cacheprovider -rfE ${PYTEST_K:+-k "$PYTEST_K"} \
    >"$out/tests.log" 2>&1
echo "pytest exit: $?"; grep -E "passed|failed|error" "$out/tests.log" | tail -3; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -30
fi

if [[ " $steps " == *" bench "* ]]; then
step benchmark
OUT="$out" WARM_LOAD_REPEATS="${WARM_LOAD_REPEATS:-5}" timeout "${BENCH_TIMEOUT:-400}" benchmarks/run_bench.sh ${BENCH_ARGS:-} \
    >"$out/bench.log" 2>&1
echo "bench exit: $?"; tail -45 "$out/bench.log"
fi
