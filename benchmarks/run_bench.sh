#!/usr/bin/env bash
# Regenerates benchmarks/RESULTS.md (with results.json and speedups.png beside it) on the GPU machine,
# then the load-time numbers (warm_load.json). Every number in those files comes from this run.
#
#   benchmarks/run_bench.sh                 # all ops, the issue's target shapes, forward and forward+backward
#   benchmarks/run_bench.sh softmax relu    # some ops (anything after the script's name goes to `opbuilder bench`)
#
# OUT=folder puts the files there instead of benchmarks/ (on the device machine: OUT=$OUT, or nothing comes back).
# WARM_LOAD_REPEATS=N fresh processes per warm-load measurement (default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks}"
mkdir -p "$out"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

plot=()
if "$python" -c "import matplotlib" 2>/dev/null; then
    plot=(--plot "$out/speedups.png")
else
    echo "matplotlib not installed: no speedups.png (pip install 'opbuilder[plot]')" >&2
fi

status=0
"$python" -m opbuilder.bench --backward --json "$out/results.json" --markdown "$out/RESULTS.md" ${plot[@]+"${plot[@]}"} "$@" \
    || status=$?
"$python" benchmarks/warm_load.py --repeats "${WARM_LOAD_REPEATS:-10}" --json "$out/warm_load.json" || status=$?
exit "$status"
