# Nineteenth session (issue 23): OUT=$OUT bash benchmarks/tuning/gpu_session19.sh PART   (carry .whl: liger-kernel)
#   PART 1: gpu_tests.sh 1 (tests/torchop, tests/ops, tests/dispatch on CUDA, the session's changes among them).
#   PART 2: gpu_tests.sh 2 (tests/jit, tests/tools, tests/package); `opbuilder bench` of the three cases against
#           Liger-Kernel and torch.compile; host_overhead.py; then train_step.py at dim 256 with the time left.
start=$SECONDS
if [ "${1:-1}" = 1 ]; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-440} bash benchmarks/tuning/gpu_tests.sh 1
  exit 0
fi
TEST_TIMEOUT=${TEST_TIMEOUT:-240} bash benchmarks/tuning/gpu_tests.sh 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger*.whl
source benchmarks/tuning/prelude.sh
echo "== bench against Liger ($((SECONDS - start)) s)"
PYTHONPATH=/tmp/site timeout 120 python3 -m opbuilder bench fused_add_rmsnorm --shapes 128x4096 4096x4096 --dtype bf16 \
  --no-host --json "$OUT/bench_rms.json" 2>&1 | grep -v Warning | tail -12
PYTHONPATH=/tmp/site timeout 100 python3 -m opbuilder bench softmax --shapes 4096x4096 --dtype bf16 fp32 \
  --no-host --json "$OUT/bench_softmax.json" 2>&1 | grep -v Warning | tail -12
echo "== host_overhead ($((SECONDS - start)) s)"
timeout 150 python3 benchmarks/host_overhead.py --device cuda --json "$OUT/host.json" 2>&1 | tail -17
left=$((560 - (SECONDS - start)))
echo "== $((SECONDS - start)) s used, $left s left"
if [ "$left" -gt 120 ]; then
  timeout $((left - 10)) python3 benchmarks/train_step.py --device cuda --rounds ${ROUNDS256:-15} --steps 10 \
    --sizes 256,1024,1024 --json "$OUT/train256.json" 2>&1 | grep -v Warning | tail -8
fi
exit 0
