# Twelfth session (issue 23, item 4): add+RMSNorm 128 x 4096 bf16 against Liger, forward kernel variants
# (quick_rmsnorm.py's q_fwd list) under opbuilder's timer in turns and under Nsight Compute; then, if TESTS=1,
# the CUDA tests of tests/torchop, tests/ops, tests/dispatch (gpu_tests.sh 1) within ${TEST_TIMEOUT:-360} s.
#   here:   TORCH_CUDA_ARCH_LIST=9.0 python benchmarks/tuning/quick_rmsnorm.py --build
#   device: OUT=$OUT bash benchmarks/tuning/gpu_rms128.sh    (carry .whl and build/quick_rms)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger*.whl && export PYTHONPATH=/tmp/site
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=/tmp/site:benchmarks/tuning
echo "== timer, ${ROUNDS:-7} rounds"
timeout 150 python3 benchmarks/tuning/quick_rmsnorm.py --rows 128 --no-backward --rounds ${ROUNDS:-7} 2>&1 | grep -v Warning
M=gpu__time_duration.sum,launch__block_size,launch__registers_per_thread,smsp__inst_executed.sum,sm__cycles_active.avg
echo "== ncu"
timeout 150 ncu --metrics $M --kernel-name regex:'forward|atomic|rms' --launch-skip ${SKIP:-0} --launch-count 40 \
  python3 benchmarks/tuning/quick_rmsnorm.py --rows 128 --ncu >"$OUT/ncu.log" 2>&1
echo "ncu exit: $?"
grep -E "^  [a-zA-Z_].*\(|duration|block_size|registers|inst_exec|cycles_active|ncu launches" "$OUT/ncu.log" | head -120
[ "${TESTS:-0}" = 1 ] && TEST_TIMEOUT=${TEST_TIMEOUT:-360} bash benchmarks/tuning/gpu_tests.sh 1
exit 0
